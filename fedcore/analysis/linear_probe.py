"""FedPFT Tables 1, 4, 5, 8: linear probes, original accuracy and the "match" layer of one trained run.

Per client (its personalised model, loaded as the engine scores it; FedAvg: the global model), in eval mode
(BatchNorm running statistics), on its own train and test images without augmentation (spec fedpft §1.12, §8 A9):

* ``probe``: a fresh ``Linear(m, C)`` (PyTorch's default init) trained on the client's train features, frozen
  extractor, scored on its test features; one row per feature kind (``feature_maps``):
  ``default`` = what the model's classifier reads (whole-model methods: the body's pooled feature; FedPFT: the
  transformed feature τ([φ(x), p_κ])_0, spec §1.12a) and, for FedPFT only, ``phi`` = φ(x), ``none`` = τ([φ(x)])_0,
  ``p_kappa`` (= ``default``) and ``p_rho`` = τ([φ(x), p_ρ])_0 (Table 5, §1.12c);
* ``origin``: the model's own test accuracy (its evaluator's prediction, as the run logged it);
* ``match``: a linear layer W ∈ R^{m×m} (+ bias, W = I, b = 0 at start) inserted between the ``default`` feature
  and the frozen classifier h, trained with CE on the train features (§1.12b, §8 A10); only where the method's
  prediction is h(feature) (checked at W = I), else NaN.

Training (§1.12a [R]): SGD lr 0.01, momentum 0.9, no weight decay, batch 100, 100 epochs, the final epoch's test
accuracy; every draw (init, batch order) from a generator keyed by (run seed, client, probe stream): deterministic.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedcore.analysis.trained_run import check_against_log, load_trained_run, logged_final_accuracy, run_diverged
from fedcore.engine.precision import autocast_for
from fedcore.engine.sampling import stream_seed
from fedcore.io import atomic_path

COLUMNS = ["paper", "experiment", "method", "scale", "seed", "client", "feature", "measure", "value", "n_train",
           "n_test"]
MEASURES = ("probe", "origin", "match")
FEATURES = ("default", "phi", "none", "p_kappa", "p_rho")
PROBE_STREAM, MATCH_STREAM = 0x11B, 0x11C


@dataclass(frozen=True)
class ProbeSettings:
    """The probe's optimiser and budget (spec fedpft §1.12a: NOT STATED in the paper; these are the spec's)."""

    epochs: int = 100
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 100

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "ProbeSettings":
        """From a config mapping; an unknown key is an error naming the allowed ones."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"linear probe settings: unknown key(s) {unknown}; allowed {sorted(cls.__dataclass_fields__)}")
        return cls(**d)


def feature_maps(model: nn.Module) -> dict[str, Callable[[Tensor], Tensor]]:
    """The feature kinds of ``model`` (see the module docstring), each a map from model input to (B, m)."""
    maps: dict[str, Callable[[Tensor], Tensor]] = {"default": model.features}
    tau = getattr(model, "tau", None)
    if tau is not None and hasattr(model, "transform"):  # FedPFT's PFTModel: φ, then τ with a prompt set
        maps["phi"] = model.net
        maps["none"] = lambda x: model.transform(model.net(x), None)
        if getattr(model, "p_kappa", None) is not None:
            maps["p_kappa"] = model.features
        if getattr(model, "p_rho", None) is not None:
            maps["p_rho"] = lambda x: model.transform(model.net(x), model.p_rho)
    elif hasattr(model, "net"):  # whole-model methods and FedPFT without τ: φ is what the head reads
        maps["phi"] = model.features
    return maps


def fit_sgd(params: list[Tensor], forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor,
            settings: ProbeSettings, gen: torch.Generator) -> None:
    """``settings.epochs`` epochs of CE(forward(x_batch), y_batch) by SGD over ``params``, batches shuffled by ``gen``."""
    opt = torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum, weight_decay=0.0)
    n = len(y)
    for _ in range(settings.epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        for s in range(0, n, settings.batch_size):
            i = order[s:s + settings.batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x[i]), y[i]).backward()
            opt.step()


def accuracy(logits: Tensor, y: Tensor) -> float:
    """Top-1 accuracy (NaN without samples)."""
    return float((logits.argmax(dim=1) == y).float().mean()) if len(y) else float("nan")


def linear_probe(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, num_classes: int,
                 settings: ProbeSettings, seed: int) -> float:
    """Test accuracy of a fresh linear classifier trained on frozen train features (default init, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # nn.Linear's default init draws from the global generator
        probe = nn.Linear(train_x.shape[1], num_classes).to(train_x.device)
    fit_sgd(list(probe.parameters()), probe, train_x, train_y, settings, gen)
    with torch.no_grad():
        return accuracy(probe(test_x), test_y)


def match_accuracy(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, head: nn.Module,
                   settings: ProbeSettings, seed: int) -> float:
    """Test accuracy of head(W f + b) with the classifier frozen and W (identity at start), b (0) trained."""
    m = train_x.shape[1]
    layer = nn.Linear(m, m).to(train_x.device)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(m, device=train_x.device))
        layer.bias.zero_()
    frozen = {k: v.detach().float() for k, v in head.state_dict().items()}
    readout = lambda f: torch.func.functional_call(head, frozen, (layer(f),)).float()  # noqa: E731
    fit_sgd(list(layer.parameters()), readout, train_x, train_y, settings, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return accuracy(readout(test_x), test_y)


def probe_run(run, identity: dict[str, Any], settings: ProbeSettings,
              logged: dict[int, float] | None = None) -> pd.DataFrame:
    """Every client's probe, origin and match rows of one rebuilt run (``TrainedRun``); with ``logged`` (each
    client's final-round accuracy from the run's metrics), a rebuild that does not reproduce it is an error."""
    seed = int(identity["seed"])
    rows, origin, n_test = [], {}, {}
    base = {k: identity[k] for k in ("paper", "experiment", "method", "scale")} | {"seed": seed}
    num_classes = run.method.num_classes
    for c in range(run.num_clients):
        model = run.client_model(c)
        maps = feature_maps(model)
        feats = {k: (run.apply(f, "train", c), run.apply(f, "test", c)) for k, f in maps.items() if k != "p_kappa"}
        (trx, try_), (tex, tey) = feats["default"]
        n_test[c] = len(tey)
        row = lambda feature, measure, value: {**base, "client": c, "feature": feature, "measure": measure,  # noqa: E731
                                               "value": value, "n_train": len(try_), "n_test": len(tey)}
        pred, _ = run.predictions(c, model)
        origin[c] = accuracy(pred, tey)
        rows.append(row("default", "origin", origin[c]))
        pseed = stream_seed(seed, 0, c, PROBE_STREAM)
        for name, ((a, ay), (b, by)) in feats.items():
            rows.append(row(name, "probe", linear_probe(a, ay, b, by, num_classes, settings, pseed)))
            if name == "default" and "p_kappa" in maps:  # FedPFT's classifier input: the same feature, same number
                rows.append(row("p_kappa", "probe", rows[-1]["value"]))
        head = getattr(model, "head", None)
        value = float("nan")
        if isinstance(head, nn.Module) and predicts_with_head(pred, head, tex):
            value = match_accuracy(trx, try_, tex, tey, head, settings, stream_seed(seed, 0, c, MATCH_STREAM))
        rows.append(row("default", "match", value))
    if logged is not None:
        where = f"run {identity['experiment']}/{identity['method']}/seed{seed}"
        check_against_log(origin, logged, n_test, where)
    return pd.DataFrame(rows, columns=COLUMNS)


@torch.no_grad()
def predicts_with_head(logits: Tensor, head: nn.Module, feats: Tensor) -> bool:
    """Whether the method's test logits are head(feature) (then the match layer sits between the two)."""
    if len(feats) == 0:
        return False
    w = next(head.parameters())
    # under the autocast the logits were made in (TrainedRun.apply: bf16 on CUDA): an fp32 head(feats) differs from
    # bf16 logits of a few units by ~1e-2, beyond the tolerance, and the match layer would silently become NaN
    with autocast_for(feats):
        ref = head(feats.to(w.dtype)).float()
    return bool(torch.allclose(logits, ref, atol=1e-3, rtol=1e-3))


def write_probe(run_args: dict[str, Any], out_csv: str | os.PathLike, metrics_path: str | os.PathLike | None = None,
                settings: dict[str, Any] | None = None, device: str = "auto") -> pd.DataFrame:
    """Rebuild the run (``load_trained_run(**run_args)``), probe every client, write the rows as CSV atomically; with
    ``metrics_path`` (the run's metrics) a rebuild that does not reproduce the logged final accuracy is an error,
    and every row says whether the run diverged (column ``diverged``: its probe tables mark the cell !)."""
    probe_settings = ProbeSettings.from_dict(settings)  # a bad key fails before the run is loaded
    run = load_trained_run(device=device, **run_args)
    logged = logged_final_accuracy(metrics_path) if metrics_path is not None else None
    table = probe_run(run, run_args["identity"], probe_settings, logged)
    table["diverged"] = run_diverged(metrics_path) if metrics_path is not None else False
    with atomic_path(Path(out_csv)) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    return table
