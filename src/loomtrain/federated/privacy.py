"""Privacy accounting of client-level differential privacy: ε after each round at ``--dp-delta``.

The mechanism is the client-side one of ``client.py``'s ``privatize`` (DP-FedAvg, McMahan et al.,
ICLR 2018, Alg. 1, with the noise added on the clients): each sampled client clips its update to
L2 norm ``C`` and adds Gaussian noise of standard deviation ``z·C/√m`` (``m`` clients per round).
The unit of privacy is one client's whole data (a hospital), because the clipping bounds a client's
whole update. What a round releases, and to whom, depends on ``--secure``:

- ``mask`` and ``ckks``: the server sees only the sum of the surviving clients' updates, each
  scaled by its example share ``r_i`` (FedAvg's weight). The sum's noise has standard deviation
  ``√(Σ r_i²) · z·C/√m`` against a sensitivity of ``r_j·C`` for client ``j`` (its clipped update
  added or removed), so the round is a Gaussian mechanism of noise multiplier
  ``z·√(Σ r_i²)/(√m · max r_i)`` for the most exposed client: ``z`` with ``m`` equal shares and
  nobody dropped, ``z·√(k/m)`` with ``k`` equal survivors (the dropped clients' noise is missing),
  less with unequal shares (a large client's update stands out of the others' noise).
- ``none``: the server sees every update, each a Gaussian mechanism of noise multiplier ``z/√m`` on
  its own client's data; the guarantee against the server is that one, not the sum's.

Clients are sampled for a round with rate ``q = m / N``; the guarantee over rounds composes the
subsampled Gaussian mechanism with Rényi DP (Mironov, CSF 2017; Mironov, Talwar & Zhang 2019 for the
subsampled Gaussian), computed by Opacus's ``RDPAccountant``, the well-kept implementation. That
analysis assumes Poisson sampling (each client joins a round independently with probability
``q``); Flower's sampling picks exactly ``m`` clients, so the figure is the standard approximation
DP-FedAvg's papers use, not a proof for sampling without replacement (Wang, Balle &
Kasiviswanathan, AISTATS 2019, bound that case).
"""

from __future__ import annotations

import math


def round_noise_multiplier(noise: float, sampled: int, weights: list[float], secure: str) -> float:
    """The noise multiplier of what the server sees in one round (module docstring), for the client
    it exposes most: ``z·√(Σ w²)/(√m · max w)`` of the weighted sum under ``mask`` or ``ckks`` (``w``
    the survivors' FedAvg weights, any scale; ``m`` clients sampled), ``z/√m`` of each update under
    ``none``.

    Raises:
        ValueError: ``sampled`` below 1, no survivor, more survivors than sampled, or a weight not positive.
    """
    if sampled < 1 or not 1 <= len(weights) <= sampled or min(weights, default=0) <= 0:
        raise ValueError(f"weights={weights} of sampled={sampled}: need 1 to sampled positive weights")
    if secure == "none":
        return noise / math.sqrt(sampled)
    return noise * math.sqrt(sum(w * w for w in weights)) / (math.sqrt(sampled) * max(weights))


def epsilon(history: list[list[float]], delta: float) -> float:
    """ε of the rounds in ``history`` (``[noise multiplier, sample rate]`` per round) at ``delta``,
    composed with Opacus's RDP accountant; ``inf`` when a round had no noise.

    Raises:
        ValueError: ``delta`` outside (0, 1).
    """
    if not 0 < delta < 1:
        raise ValueError(f"--dp-delta {delta}: must lie in (0, 1)")
    if any(z <= 0 for z, _ in history):
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for z, q in history:
        accountant.step(noise_multiplier=z, sample_rate=q)
    return float(accountant.get_epsilon(delta)) if history else 0.0
