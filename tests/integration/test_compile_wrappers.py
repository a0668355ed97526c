"""A torch.compile wrapper *around* the watched model, made where the monitor cannot see it (issue 30 item 1).

The monitor is handed ``net`` and the loop trains through a compiled wrapper of it that the monitor
never sees: ``torch.compile(net)`` made after the tracker got ``net``, ``net.forward =
torch.compile(net.forward)``, a compiled function that calls ``net`` (a compiled loss or train
step), ``torch.compile(DDP(net))`` (``tests/scripts/compile_ddp.py``), and a LightningModule whose
forward calls a compiled forward of its network kept as a plain attribute. Dynamo then traces the
monitor's hooks (and, with kernel statistics, its wrappers of the attention functions) into the
training graph: before issue 30, 14 to 27 graphs and 11 to 22 graph breaks for 1 and 0, and
trained weights that differ.

Each test trains twice from the same seed, without and with the monitor (SGD, dropout on,
``backend="aot_eager"``: the same Dynamo guards as inductor, fast on CPU), and asserts that the
number of graphs and the graph breaks (``torch._dynamo.utils.counters``) are those of the run
without the monitor, that every trained weight is equal bit for bit, that the weight-based HDI is
logged at every measured step, that no activation or kernel statistic is logged (the wrapper cannot
be measured: nothing partial), and that exactly one `MonitoringWarning` says so, naming what to pass
instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from hdi_monitor import HDIMonitor, HDITracker
from hdi_monitor.monitor.tracker import MonitoringWarning
from integration.test_compile_checkpoint import EVERY, MEASURED, SPEC, DropNet, _dynamo_counts, batches

PATTERNS = ["module", "forward", "function"]
LAYERS = ["blocks.0.attn", "blocks.1.attn"]


def _loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, 128), y.reshape(-1))


def _wrap(net: nn.Module, pattern: str):
    """``(x, y) -> loss`` through a compiled wrapper of ``net`` that the monitor does not see."""
    if pattern == "module":  # torch.compile(model) made after the tracker got the model
        compiled = torch.compile(net, backend="aot_eager")
        return lambda x, y: _loss(compiled(x), y)
    if pattern == "forward":  # the model's forward replaced by a compiled one
        net.forward = torch.compile(net.forward, backend="aot_eager")
        return lambda x, y: _loss(net(x), y)
    if pattern == "function":  # a compiled loss function calling the model

        @torch.compile(backend="aot_eager")
        def step(x: Tensor, y: Tensor) -> Tensor:
            return _loss(net(x), y)

        return step
    raise ValueError(pattern)


def _monitoring(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]


def _plain_loop(pattern: str, monitor: bool, *, kernel_stats: bool = False, before=None) -> dict:
    """SGD (lr 0.1) on a dropout model trained through ``pattern``; measured every 2nd step;
    ``before(net, loss_of)`` runs first (a warm-up call). Pattern ``"nested"``: the tracker is given
    ``torch.compile(net)``, called from a compiled loss function."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = DropNet()
    watched: nn.Module = net
    if pattern == "nested":
        watched = torch.compile(net, backend="aot_eager")
    tracker = None
    if monitor:
        tracker = HDITracker(
            watched,
            every_n_steps=EVERY,
            spec=SPEC,
            log_images_every_n_steps=0,
            max_tokens=None,
            kernel_stats=kernel_stats,
            detector=None,
            strict=True,
        )
    loss_of = _wrap(watched, "function") if pattern == "nested" else _wrap(net, pattern)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        if before is not None:
            before(net, loss_of)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches():
                with tracker.capture(x) if tracker is not None else contextlib.nullcontext():
                    loss = loss_of(x, y)
                loss.backward()
                if tracker is not None:
                    tracker.step()
                optimizer.step()
                optimizer.zero_grad()
            if tracker is not None:
                tracker.close()
        counts = _dynamo_counts()
    finally:
        torch._dynamo.reset()
    weights = [p.detach().clone() for p in net.parameters()]
    return {"weights": weights, "counts": counts, "tracker": tracker, "warnings": _monitoring(caught)}


def _assert_same_training(plain: dict, watched: dict) -> None:
    """The same graphs and graph breaks as the run without the monitor, and the same weights, bit for bit."""
    assert plain["counts"][0] >= 1  # something was compiled
    differ = sum(not torch.equal(a, b) for a, b in zip(watched["weights"], plain["weights"], strict=True))
    (graphs, breaks), (plain_graphs, plain_breaks) = watched["counts"], plain["counts"]
    summary = (
        f"{graphs} graphs and {sum(breaks.values())} graph breaks with the monitor, {plain_graphs} and "
        f"{sum(plain_breaks.values())} without; {differ} of {len(plain['weights'])} trained tensors differ"
    )
    assert (watched["counts"], differ) == (plain["counts"], 0), summary


def _assert_weights_only_with_one_warning(history, messages: list[str], layers=LAYERS) -> None:
    """The weight-based HDI at every measured step, no activation or kernel statistic at any, and
    one MonitoringWarning in the whole run, naming what to pass."""
    assert history.steps == MEASURED
    for row in history:
        assert all(f"hdi/key/{name}" in row for name in layers)
        partial = [k for k in row if k.split("/")[0] in ("effective_heads", "head_correlation", "attention_entropy")]
        assert partial == [], f"step {row['step']}: {partial}"
    assert len(messages) == 1, messages
    (message,) = messages
    assert "torch.compile" in message and "HDITracker(torch.compile(model))" in message
    assert "activation statistics" in message


@pytest.mark.slow
@pytest.mark.parametrize("kernel_stats", [False, True], ids=["hooks", "kernel_stats"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_compile_wrapper_the_monitor_cannot_see_keeps_the_graphs_and_the_training(pattern, kernel_stats):
    """``torch.compile(net)`` made after ``HDITracker(net)``, ``net.forward = torch.compile(net.forward)``,
    and a compiled loss function calling ``net``; with and without kernel statistics."""
    plain = _plain_loop(pattern, False)
    watched = _plain_loop(pattern, True, kernel_stats=kernel_stats)
    _assert_same_training(plain, watched)
    _assert_weights_only_with_one_warning(watched["tracker"].history, watched["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("kernel_stats", [False, True], ids=["hooks", "kernel_stats"])
@pytest.mark.parametrize("pattern", ["forward", "function"])
def test_a_wrapper_compiled_before_the_first_measured_step_keeps_the_graphs(pattern, kernel_stats):
    """A warm-up call compiles the wrapper before the first measured step (a resumed run does the
    same): the cached graph never calls the monitor's hooks, and the kernel capture's wrappers of the
    attention functions are only put on while a watched layer's forward runs eagerly, so no guard
    of that graph fails (before, with kernel statistics, the first measured step recompiled).
    Nothing ran while the capture was on: one MonitoringWarning says so, naming both causes."""

    def warm(net: nn.Module, loss_of) -> None:
        x, y = batches()[0]
        loss_of(x, y).backward()  # compiled here, outside any measured step
        net.zero_grad()

    plain = _plain_loop(pattern, False, before=warm)
    watched = _plain_loop(pattern, True, kernel_stats=kernel_stats, before=warm)
    _assert_same_training(plain, watched)
    history = watched["tracker"].history
    assert history.steps == MEASURED
    assert all(k.split("/")[0] not in ("effective_heads", "attention_entropy") for row in history for k in row)
    (message,) = watched["warnings"]
    assert "no watched layer ran while the capture was on" in message
    assert "HDITracker(torch.compile(model))" in message


@pytest.mark.slow
def test_a_compiled_function_calling_the_compiled_module_the_tracker_watches():
    """``HDITracker(torch.compile(net))`` with the loop calling that wrapper from a compiled loss
    function: Dynamo inlines the wrapper there without running its hooks, so the side forward never
    runs. The graphs and the training are those of the run without the monitor, the weight-based
    HDI is logged, and one warning says that nothing ran and to compile the model, not the function."""
    plain = _plain_loop("nested", False)
    watched = _plain_loop("nested", True)
    _assert_same_training(plain, watched)
    layers = [f"_orig_mod.{name}" for name in LAYERS]
    history = watched["tracker"].history
    assert history.steps == MEASURED
    assert all(f"hdi/key/{name}" in row and f"effective_heads/{name}" not in row for row in history for name in layers)
    (message,) = watched["warnings"]
    assert "no watched layer ran while the capture was on" in message
    assert "compile the model instead of the function" in message


def _llama_run(monitor: bool, implementation: str, pattern: str) -> dict:
    """A tiny Llama (GQA, RoPE, attention dropout 0.1) trained 4 SGD steps through a wrapper the
    monitor was not given, with kernel statistics (the transformers registry and eager paths)."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.1, attn_implementation=implementation,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    tracker = None
    if monitor:
        tracker = HDITracker(
            model, every_n_steps=2, log_images_every_n_steps=0, max_tokens=None, kernel_stats=True, strict=True
        )
    if pattern == "module":
        compiled = torch.compile(model, backend="aot_eager")

        def loss_of(batch: dict[str, Tensor]) -> Tensor:
            return compiled(**batch, labels=batch["input_ids"]).loss

    else:

        @torch.compile(backend="aot_eager")
        def loss_of(batch: dict[str, Tensor]) -> Tensor:
            return model(**batch, labels=batch["input_ids"]).loss

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                ids = torch.randint(0, 64, (2, 9), generator=g)
                mask = torch.ones_like(ids)
                mask[0, :2] = 0
                batch = {"input_ids": ids, "attention_mask": mask}
                with tracker.capture(batch) if tracker is not None else contextlib.nullcontext():
                    loss = loss_of(batch)
                loss.backward()
                if tracker is not None:
                    tracker.step()
                optimizer.step()
                optimizer.zero_grad()
            if tracker is not None:
                tracker.close()
        counts = _dynamo_counts()
    finally:
        torch._dynamo.reset()
    weights = [p.detach().clone() for p in model.parameters()]
    return {"weights": weights, "counts": counts, "tracker": tracker, "warnings": _monitoring(caught)}


@pytest.mark.slow
@pytest.mark.parametrize(("implementation", "pattern"), [("sdpa", "module"), ("eager", "function")])
def test_a_transformers_model_with_kernel_statistics_behind_a_wrapper_the_monitor_cannot_see(implementation, pattern):
    """Llama with kernel statistics (the capture wraps the transformers attention registry or the
    modeling file's eager function), trained through ``torch.compile(model)`` made after the tracker
    or a compiled loss function: graphs, graph breaks and weights as without the monitor (before: 28
    and 29 graphs, 20 to 23 breaks, 16 and 17 trained tensors different), the weight-based HDI and
    one warning naming kernel statistics."""
    plain = _llama_run(False, implementation, pattern)
    watched = _llama_run(True, implementation, pattern)
    _assert_same_training(plain, watched)
    layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    history = watched["tracker"].history
    assert history.steps == [0, 2]
    for row in history:
        assert all(f"hdi/key/{name}" in row for name in layers)
        assert not any(k.split("/")[0] in ("effective_heads", "attention_entropy") for k in row)
    (message,) = watched["warnings"]
    assert "activation statistics (covariance, effective heads) and kernel statistics" in message


class HiddenCompiledLM(pl.LightningModule):
    """A LightningModule whose forward calls a compiled forward of its network kept as a plain
    attribute (a function, not a submodule): the monitor finds ``net``'s layers, not the wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DropNet()
        self.compiled_forward = torch.compile(self.net.forward, backend="aot_eager")

    def forward(self, tokens: Tensor) -> Tensor:
        return self.compiled_forward(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return _loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning_run(monitor: bool) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = HiddenCompiledLM()
    callbacks = []
    if monitor:
        callbacks = [
            HDIMonitor(
                every_n_steps=EVERY, spec=SPEC, log_images_every_n_steps=0, detector=None, max_tokens=None, strict=True
            )
        ]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=len(batches()),
        logger=False,
        callbacks=callbacks,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, DataLoader(batches(), batch_size=None))
        counts = _dynamo_counts()
    finally:
        torch._dynamo.reset()
    weights = [p.detach().clone() for p in model.parameters()]
    return {"weights": weights, "counts": counts, "callbacks": callbacks, "warnings": _monitoring(caught)}


@pytest.mark.slow
def test_lightning_module_calling_a_compiled_forward_it_keeps_as_an_attribute():
    """HDIMonitor on a LightningModule whose forward runs ``torch.compile(self.net.forward)`` held
    as a plain attribute: graphs, graph breaks and trained weights as without the callback, the
    weight-based HDI at every measured step, one warning naming what to pass."""
    plain = _lightning_run(False)
    watched = _lightning_run(True)
    _assert_same_training(plain, watched)
    (monitor,) = watched["callbacks"]
    names = [f"net.{name}" for name in LAYERS]
    assert [la.name for la in monitor.tracker.layers] == names
    _assert_weights_only_with_one_warning(monitor.history, watched["warnings"], layers=names)


# ------------------------------------------------------------------------------ the trace-time signal


def _traced_hook_run(on_traced=None) -> tuple[int, list, list]:
    """A SpecNet whose first layer's head-output hook (with a `TraceSignal` when ``on_traced`` is
    given) is attached before the model is compiled, then called three times through
    ``torch.compile``; returns the graph count, what the hook received and when the signal fired
    (``"trace"`` while Dynamo traced, ``"run"`` otherwise)."""
    from torch._dynamo.utils import counters

    from hdi_monitor import discover_attention
    from hdi_monitor.models.base import TraceSignal

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = DropNet().eval()
    layer = discover_attention(net, spec=SPEC).layers[0]
    seen: list[Tensor] = []
    told: list[str] = []
    handles = []

    def tell() -> bool:
        told.append("trace" if torch._dynamo.is_compiling() or _tracing() else "run")
        return on_traced(handles) if on_traced is not None else False

    if on_traced is not None:
        signal = TraceSignal(tell)
        handles.append(layer.attach_output_hook(lambda o, keep: seen.append(o), signal=signal))
    compiled = torch.compile(net, backend="aot_eager")
    x = batches()[0][0]
    try:
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
        for handle in handles:
            handle.remove()
    return graphs, seen, told


def _tracing() -> bool:
    """True inside Dynamo's compilation (where the trace-time call runs, outside any traced frame)."""
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


def test_a_traced_hook_tells_its_owner_once_at_trace_time_and_leaves_nothing_in_the_graph():
    """A monitor hook reached by Dynamo never runs its function. Its signal fires once, while Dynamo
    traces, and never when the compiled graph runs (nothing of it is replayed): three calls, one
    signal. An owner that takes the hook off and returns True gets the graph of the model without
    any hook (Dynamo traced again); one that returns False keeps its hook, traced as a no-op."""
    plain_graphs, _, _ = _traced_hook_run()

    def take_off(handles) -> bool:
        for handle in handles:
            handle.remove()
        return True

    graphs, seen, told = _traced_hook_run(take_off)
    assert (graphs, seen, told) == (plain_graphs, [], ["trace"])
    graphs, seen, told = _traced_hook_run(lambda handles: False)
    assert (graphs, seen, told) == (plain_graphs, [], ["trace"])


# ------------------------------------------------------------------------------ DDP (2 gloo ranks)

DDP_SCRIPT = Path(__file__).parents[1] / "scripts" / "compile_ddp.py"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--unused", "--kernel-stats"]], ids=["hooks", "unused_output-kernel_stats"])
def test_compiled_ddp_with_the_tracker_on_the_inner_module(tmp_path, extra, gloo2):
    """``torch.compile(DDP(net))`` on 2 gloo ranks with ``HDITracker(net)``: on every rank the graphs,
    graph breaks and trained weights of the run without the monitor (with an output the loss does
    not use, DDP's default ``find_unused_parameters=False``: before, the run died at step 1,
    "Expected to have finished reduction"), the weight-based HDI and one warning on rank 0. The
    advice it gives, ``HDITracker(compiled)``, trains the same and measures the head outputs (and
    kernel statistics): step 0 equals one process measuring both ranks' batches."""
    gloo2.run(DDP_SCRIPT, "scenario", str(tmp_path), "--unused" in extra, "--kernel-stats" in extra, timeout_s=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, runs in enumerate(ranks):
        errors = {run: res["error"] for run, res in runs.items() if "error" in res}
        assert errors == {}, f"rank {rank}: {errors}"
        plain = runs["plain"]
        for run in ("net", "wrapper"):
            got = runs[run]
            differ = [n for n, w in got["weights"].items() if not torch.equal(w, plain["weights"][n])]
            counts = (got["graphs"], got["breaks"])
            assert (counts, differ) == ((plain["graphs"], plain["breaks"]), []), f"rank {rank}, {run}"
    net, wrapper = ranks[0]["net"], ranks[0]["wrapper"]
    _assert_weights_only_with_one_warning(_Rows(net["history"]), net["warnings"])
    assert ranks[1]["net"]["warnings"] == []  # rank 0 speaks for the run
    assert wrapper["warnings"] == []
    # the advice measures: step 0 (the initial weights) against one process over both ranks' batches
    dm = _load_script(DDP_SCRIPT)
    unused, kernel_stats = "--unused" in extra, "--kernel-stats" in extra
    torch.manual_seed(0)
    reference = HDITracker(dm.Net(unused), spec=dm.spec(), max_tokens=None, kernel_stats=kernel_stats, strict=True)
    both = torch.cat([dm.batches(0)[0][0], dm.batches(1)[0][0]])
    expected = reference.measure(both).scalars
    first = wrapper["history"][0]
    assert first["step"] == 0
    for name in LAYERS:
        families = ["effective_heads", "head_correlation"] + ["attention_entropy", "max_attention_logit"] * kernel_stats
        for family in families:
            assert first[f"{family}/_orig_mod.module.{name}"] == pytest.approx(expected[f"{family}/{name}"], rel=1e-5)


class _Rows(list):
    """History rows saved by the script, with the `History.steps` the shared assertion reads."""

    @property
    def steps(self) -> list[int]:
        return [int(row["step"]) for row in self]


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
