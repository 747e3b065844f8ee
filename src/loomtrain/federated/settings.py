"""The settings of one federated run (``loomtrain fl run`` flags), checked before anything starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loomtrain.federated.compress import METHODS

SECURE = ("none", "ckks", "mask")
STRATEGIES = ("fedavg", "fedprox", "fedadam")
# Local optimiser defaults per task: SGD for the MLP, AdamW (fresh each round) for the transformer.
TASK_DEFAULTS = {"tabular": {"lr": 0.05, "local_steps": 10, "batch_size": 32},
                 "text": {"lr": 2e-3, "local_steps": 20, "batch_size": 12}}  # fmt: skip


@dataclass
class FLSettings:
    """One federated run. Fields mirror the ``loomtrain fl run`` flags (docs/federated.md).

    ``lr``/``local_steps``/``batch_size`` of 0 take the task's default (:data:`TASK_DEFAULTS`).
    ``local_procs``: processes each client trains on, with loomtrain's data parallelism (1: one).
    ``proximal_mu``: FedProx's μ (Li et al., MLSys 2020, eq. 2), used by ``fedprox`` only.
    ``server_lr``, ``beta1``, ``beta2``, ``tau``: FedAdam's η, β₁, β₂, τ (Reddi et al., ICLR 2021, Alg. 2).
    ``dp_clip`` (L2 norm) and ``dp_noise`` (noise multiplier z): client-side Gaussian mechanism, 0 = off;
    ``dp_delta``: the δ at which each round's cumulative ε is reported (``federated/privacy.py``).
    ``drop``: fault injection, ``"client@round:stage"`` items (stage ``fit``, ``mask_input`` ...): that
    client disconnects (raises) when it gets that stage of that round.
    ``mask_clip``: masking's fixed-point range: update coordinates are clipped to ±mask_clip before
    quantization (a clipped coordinate is reported as a ``mask_clipped`` event).
    ``timeout_s``: how long the server waits for a stage's replies before treating the silent clients
    as dropped (seconds).
    """

    task: str = "tabular"
    clients: int = 10
    rounds: int = 20
    secure: str = "none"
    strategy: str = "fedavg"
    fraction: float = 1.0
    local_steps: int = 0
    local_procs: int = 1
    batch_size: int = 0
    lr: float = 0.0
    proximal_mu: float = 0.01
    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    compress: str = "none"
    topk_ratio: float = 0.05
    dp_clip: float = 0.0
    dp_noise: float = 0.0
    dp_delta: float = 1e-5
    seed: int = 0
    out: str = "runs/fl"
    keys: str = ""
    resume: bool = False
    mask_clip: float = 1.0
    drop: list[str] = field(default_factory=list)
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        defaults = TASK_DEFAULTS.get(self.task, {})
        for name, value in defaults.items():
            if not getattr(self, name):
                setattr(self, name, value)

    def validate(self) -> FLSettings:
        """Return ``self`` after checking every field.

        Raises:
            ValueError: a field out of range or a combination that cannot work, naming the flag and the fix.
        """
        checks = [
            (self.task in TASK_DEFAULTS, f"--task {self.task!r}: use one of {', '.join(TASK_DEFAULTS)}"),
            (self.secure in SECURE, f"--secure {self.secure!r}: use one of {', '.join(SECURE)}"),
            (self.strategy in STRATEGIES, f"--strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}"),
            (self.compress in METHODS, f"--compress {self.compress!r}: use one of {', '.join(METHODS)}"),
            (self.clients >= 1, f"--clients {self.clients}: need at least 1"),
            (self.rounds >= 1, f"--rounds {self.rounds}: need at least 1"),
            (self.local_procs >= 1 and self.batch_size % self.local_procs == 0, f"--local-procs {self.local_procs}: "
             f"give a divisor of the batch size {self.batch_size} (each process takes an equal share of a batch)"),
            (0 < self.fraction <= 1, f"--fraction {self.fraction}: must lie in (0, 1]"),
            (self.secure != "mask" or self.sampled() >= 2, "--secure mask needs at least 2 clients per round; "
             "raise --clients or --fraction"),
            (self.secure != "ckks" or self.strategy != "fedadam", "--strategy fedadam needs the mean update in the "
             "clear on the server; with --secure ckks the server only holds ciphertexts: use fedavg or fedprox"),
            (self.secure == "none" or self.compress == "none", f"--compress {self.compress} with --secure "
             f"{self.secure}: masked vectors and ciphertexts are dense, so compressing first saves no bytes; "
             "use --secure none or --compress none"),
            (self.dp_clip >= 0 and self.dp_noise >= 0, "--dp-clip and --dp-noise must be >= 0"),
            (self.dp_noise == 0 or self.dp_clip > 0, "--dp-noise needs --dp-clip > 0 (the noise is scaled by it)"),
            (0 < self.dp_delta < 1, f"--dp-delta {self.dp_delta}: must lie in (0, 1); below 1/--clients is usual"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    def sampled(self) -> int:
        """Clients per round: ``max(1, round(fraction · clients))``."""
        return max(1, round(self.fraction * self.clients))

    def client_config(self) -> dict:
        """The fields a client needs, as Flower ``ConfigRecord`` values (``drop`` joined by commas)."""
        d = dataclasses.asdict(self)
        d["drop"] = ",".join(self.drop)
        return d

    @classmethod
    def from_config(cls, record) -> FLSettings:
        """Inverse of :meth:`client_config` (unknown keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in dict(record).items() if k in names}
        d["drop"] = [x for x in str(d.get("drop", "")).split(",") if x]
        return cls(**d)

    def drops(self, client: int, rnd: int, stage: str) -> bool:
        """Whether fault injection makes ``client`` disconnect at ``stage`` of round ``rnd``."""
        return f"{client}@{rnd}:{stage}" in self.drop
