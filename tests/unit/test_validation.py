"""Every constructor argument is checked in __init__, and a model the monitor cannot watch fails
before the first step (issue 12, item 6). A run that trains unmonitored because of a typo is not
acceptable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hdi_monitor import HDIMonitor, HDITracker

transformers = pytest.importorskip("transformers")
from hdi_monitor.integrations import HDITrainerCallback  # noqa: E402 - after the importorskip

BAD = [
    ({"layers": "self_attn("}, ValueError, r"layers is not a valid regex: 'self_attn\('"),
    ({"layers": 3}, TypeError, "layers must be a regex string or a sequence of qualified layer names"),
    ({"layers": ["a", 2]}, TypeError, "layers must be a regex string or a sequence"),
    ({"layers": []}, ValueError, r"layers=\[\] selects no attention layer"),
    ({"spec": "bert"}, TypeError, "spec must be an AttentionSpec, a list of AttentionSpec or None, got str"),
    ({"loss_tag": ""}, ValueError, "loss_tag must be a non-empty scalar tag or None"),
    ({"max_image_layers": 0}, ValueError, "max_image_layers must be an integer >= 1"),
    ({"activations": "no"}, TypeError, "activations must be True or False, got 'no'"),
    ({"activations": 0}, TypeError, "activations must be True or False"),
    ({"strict": "yes"}, TypeError, "strict must be True or False"),
    ({"seed": -1}, ValueError, r"seed must be an integer in \[0, 18446744073709551615\]"),
    ({"seed": 1.5}, ValueError, r"seed must be an integer in \[0, 18446744073709551615\]"),
    ({"seed": 2**64}, ValueError, r"seed must be an integer in \[0, 18446744073709551615\]"),
    ({"history_budget": 2**40}, ValueError, r"history_budget must be an integer in \[4, 1048576\]"),
]
CALLBACK_BAD = [
    ({"detector": "off"}, TypeError, "detector must be a SaturationDetector, 'default' or None, got str 'off'"),
    ({"activation_detector": 0.9}, TypeError, "activation_detector must be a SaturationDetector, 'default' or None"),
    # every setting is a named parameter: a misspelt or former argument is Python's own TypeError
    ({"patience": 5}, TypeError, "unexpected keyword argument 'patience'"),
    ({"early_warning": False}, TypeError, "unexpected keyword argument 'early_warning'"),
    ({"every_n_step": 5}, TypeError, "unexpected keyword argument 'every_n_step'"),
    ({"config": {"every_n_steps": 5}}, TypeError, "unexpected keyword argument 'config'"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD + CALLBACK_BAD)
@pytest.mark.parametrize("cls", [HDIMonitor, HDITrainerCallback])
def test_callbacks_check_every_argument_in_init(cls, kwargs, error, match):
    """Item 6: bad values fail in __init__ (the Lightning and Hugging Face callbacks share one check)."""
    with pytest.raises(error, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_tracker_checks_every_argument_in_init(kwargs, error, match):
    """Item 6: the plain-loop tracker runs the same checks."""
    with pytest.raises(error, match=match):
        HDITracker(nn.MultiheadAttention(8, 2), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sinks": [object()]}, TypeError, "every sink needs log_scalars"),
        ({"sinks": "tb"}, TypeError, "sinks must be a sequence"),
        ({"detector": "on"}, TypeError, "detector must be a SaturationDetector, 'default' or None"),
        ({"every_n_step": 5}, TypeError, "HDITracker got unexpected keyword argument"),
    ],
)
def test_tracker_checks_sinks_and_detectors(kwargs, error, match):
    with pytest.raises(error, match=match):
        HDITracker(nn.MultiheadAttention(8, 2), **kwargs)


def test_hf_callback_checks_its_own_arguments():
    with pytest.raises(TypeError, match="measure_at_start must be True or False"):
        HDITrainerCallback(measure_at_start="no")
    with pytest.raises(TypeError, match="log_dir must be a path"):
        HDITrainerCallback(log_dir=3)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_plain_loop_without_attention_raises_before_the_first_forward():
    """Item 6: the first capture raises (nothing trained yet) and names the model's modules and the spec."""
    model = MLP()
    tracker = HDITracker(model, every_n_steps=1)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with (
        pytest.raises(
            ValueError, match=r"no attention layer found in MLP(.|\n)*body, body\.0, body\.1, head(.|\n)*spec="
        ),
        tracker.capture(torch.randn(2, 8)),
    ):
        model(torch.randn(2, 8))
    assert calls == []


def test_hf_callback_without_attention_raises_in_on_train_begin(tmp_path):
    """Item 6: the Hugging Face callback raises in on_train_begin, before the first update."""

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": (out - labels).pow(2).mean(), "logits": out}

    data = [{"x": torch.randn(8), "labels": torch.randn(8)} for _ in range(8)]
    model = Regressor()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[HDITrainerCallback(every_n_steps=1)]
    )
    with pytest.raises(ValueError, match=r"no attention layer found in Regressor(.|\n)*net\.body"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_layers_filter_that_matches_nothing_raises_with_the_real_names():
    """Item 6: a layers filter that matches no layer raises at the first step with the available names."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    tracker = HDITracker(model, layers=r"decoder")
    with pytest.raises(
        ValueError, match=r"matches none of the 2 attention layers: \['layers\.0\.self_attn', 'layers\.1\.self_attn'\]"
    ):
        tracker.step()


def test_one_settings_object_shared_by_the_tracker_and_both_callbacks():
    """Issue 14: `MonitorConfig` is the settings of all three; keyword fields apply over a config."""
    import dataclasses

    from hdi_monitor import MonitorConfig

    base = MonitorConfig(every_n_steps=7, projections=["key"], layers=["a"])
    assert base.projections == ("key",) and base.layers == ("a",)  # normalised to tuples (frozen)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.every_n_steps = 3  # type: ignore[misc]
    expected = dataclasses.replace(base, max_tokens=16)
    assert HDIMonitor.from_config(expected).config == expected
    assert HDIMonitor(every_n_steps=7, projections=("key",), layers=["a"], max_tokens=16).config == expected
    assert HDITrainerCallback.from_config(expected).config == expected
    assert HDITrainerCallback(7, projections=["key"], layers=("a",), max_tokens=16).config == expected
    with pytest.raises(TypeError, match="HDIMonitor.from_config"):
        HDIMonitor(base)  # type: ignore[arg-type]
    tracker = HDITracker(nn.MultiheadAttention(8, 2), base, max_tokens=16)
    assert tracker.config == expected
    assert (tracker.config.every_n_steps, tracker.config.max_tokens, tracker.config.image_every_n_steps) == (7, 16, 70)


def test_default_activation_detector_follows_the_hdi_detector():
    from hdi_monitor import SaturationDetector
    from hdi_monitor.monitor.detector import ACTIVATION_COLLAPSE_DELTA, ACTIVATION_MIN_DELTA, resolve_detectors

    det = SaturationDetector(patience=4, warmup_steps=30, redundancy_threshold=0.8, min_delta=0.01)
    hdi, act = resolve_detectors(det, "default")
    assert hdi is det and act is not None
    assert (act.patience, act.warmup_steps, act.redundancy_threshold) == (4, 30, 0.8)
    assert (act.min_delta, act.collapse_delta) == (ACTIVATION_MIN_DELTA, ACTIVATION_COLLAPSE_DELTA)
    assert resolve_detectors(None, "default") == (None, None)
    assert resolve_detectors("default", "default", activations=False)[1] is None
    hdi, act = resolve_detectors("default", None)
    assert act is None and hdi is not None
    default = SaturationDetector()
    assert (hdi.patience, hdi.min_delta, hdi.warmup_steps) == (
        default.patience,
        default.min_delta,
        default.warmup_steps,
    )


def test_config_takes_a_list_of_specs_and_the_dashboard_settings():
    """`spec=` takes one spec or a list (as `head_diversity` does); the dashboard settings reach the
    tracker's dashboard."""
    from torch import nn

    from hdi_monitor import AttentionSpec, HDITracker, MonitorConfig

    one = AttentionSpec(modules=r"a$", query="q", key="k", value="v", output="o", num_heads=2)
    two = AttentionSpec(modules=r"b$", query="q", key="k", value="v", output="o", num_heads=2)
    assert MonitorConfig(spec=[one, two]).spec == (one, two)
    assert MonitorConfig(spec=[one]).spec is one
    tracker = HDITracker(
        nn.MultiheadAttention(8, 2), MonitorConfig(loss_tag="train/loss", max_image_layers=3, max_histogram_layers=2)
    )
    dash = tracker.dashboard
    assert (dash.loss_tag, dash.max_image_layers, dash.max_histogram_layers) == ("train/loss", 3, 2)
    layout = dash.layout({"key": ["x"]}, activations=False)
    assert r"^train/loss$" in str(layout)


def _args_docs(cls) -> dict[str, str]:
    """Parameter -> its description in the Google-style ``Args`` section, parsed by griffe (the
    parser that renders the API pages)."""
    import inspect

    from griffe import Docstring, DocstringSectionKind

    sections = Docstring(inspect.getdoc(cls) or "", parser="google").parse()
    params = [s for s in sections if s.kind is DocstringSectionKind.parameters]
    assert len(params) <= 1, f"{cls.__name__} has more than one Args section"
    return {p.name: " ".join(p.description.split()) for p in params[0].value} if params else {}


@pytest.mark.parametrize("cls", [HDIMonitor, HDITrainerCallback])
def test_callback_signatures_name_every_setting_with_its_default_and_doc(cls):
    """Issue 24: every `MonitorConfig` field is a named, typed parameter of the callback (visible to
    IDEs, ``help()``, the API pages and LightningCLI), with the config's default and, word for
    word, the config's documentation. A field added to `MonitorConfig` fails here until both
    callbacks name it."""
    import dataclasses
    import inspect

    from hdi_monitor import MonitorConfig
    from hdi_monitor.integrations._settings import MonitorSettings

    params = inspect.signature(cls).parameters
    assert not [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD], "no **kwargs"
    # the settings are declared once, in the shared base (its Args), the callback's own arguments in its own
    config_docs, own_docs = _args_docs(MonitorConfig), {**_args_docs(MonitorSettings), **_args_docs(cls)}
    assert issubclass(cls, MonitorSettings)
    for f in dataclasses.fields(MonitorConfig):
        assert f.name in params, f"{cls.__name__} does not name the setting {f.name!r}"
        param = params[f.name]
        assert param.annotation is not inspect.Parameter.empty, f.name
        assert param.default == f.default, f.name
        assert own_docs.get(f.name) == config_docs[f.name], f"{cls.__name__} documents {f.name!r} differently"
    for name in params:  # the other parameters are documented too
        assert name in own_docs, f"{cls.__name__} does not document {name!r}"
    # the defaults build the default config
    assert cls().config == MonitorConfig()


def test_lightning_cli_sees_every_setting():
    """LightningCLI (jsonargparse) reads the callback's settings from its signature: each field is a
    command-line option with its default."""
    import dataclasses

    pytest.importorskip("jsonargparse")
    from jsonargparse import ArgumentParser

    from hdi_monitor import MonitorConfig

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(HDIMonitor, "monitor")
    defaults = parser.get_defaults().monitor
    for f in dataclasses.fields(MonitorConfig):
        assert f.name in defaults, f.name
    parsed = parser.parse_args(["--monitor.every_n_steps=7", "--monitor.projections=[key, value]"])
    monitor = HDIMonitor(**vars(parsed.monitor))
    assert monitor.config.every_n_steps == 7 and monitor.config.projections == ("key", "value")
