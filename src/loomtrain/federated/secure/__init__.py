"""Secure aggregation without Flower: CKKS homomorphic sums (``ckks``) and pairwise masking (``mask``)."""

from loomtrain.federated.secure.errors import SecureAggregationError

__all__ = ["SecureAggregationError"]
