"""Federated learning on Flower with secure aggregation (docs/federated.md, docs/secure_aggregation.md)."""
