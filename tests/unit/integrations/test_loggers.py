"""Issue 24: heatmaps, histograms and event texts reach W&B and MLflow loggers, not only TensorBoard.

Real packages, no server: W&B in offline mode (``WANDB_MODE=offline``, files under the run folder),
MLflow with a ``sqlite:///`` tracking store and a local artifact folder. Each run is compared with a
TensorBoard logger attached to the same Trainer: the same heatmap PNGs, pixel for pixel.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch
from conftest import loader, read_events, scalar_series, tiny_lm, trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from hdi_monitor import HDIMonitor, MonitoringWarning, SaturationDetector
from hdi_monitor.integrations.loggers import LoggerSink, MLflowSink, WandbSink, sinks_for_loggers
from hdi_monitor.monitor._dashboard import image_tags

PROJECTIONS = ("query", "key", "value", "output")


def _pixels(png: bytes) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as picture:
        rgb = picture.convert("RGB")
        return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).reshape(rgb.height, rgb.width, 3)


def _tensorboard_images(log_dir: str) -> dict[tuple[str, int], bytes]:
    return {
        (tag, ev.step): ev.encoded_image_string
        for acc in read_events(log_dir)
        for tag in acc.Tags()["images"]
        for ev in acc.Images(tag)
    }


def _run(tmp_path: Path, other) -> tuple[HDIMonitor, TensorBoardLogger]:
    board = TensorBoardLogger(str(tmp_path / "tb"), name="tb")
    monitor = HDIMonitor(
        every_n_steps=2,
        log_images_every_n_steps=4,
        detector=SaturationDetector(patience=1, warmup_steps=0),  # lr = 0: flat, events by step 4
        strict=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DiversityWarning of the flat run
        trainer(tmp_path, monitor, max_steps=5, logger=[board, other]).fit(tiny_lm(lr=0.0), loader())
    return monitor, board


@pytest.mark.slow  # starts the W&B backend (seconds); CI runs it
def test_wandb_offline_run_holds_the_heatmaps_histograms_and_events(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(project="hdi", save_dir=str(tmp_path), offline=True)
    assert isinstance(sinks_for_loggers([logger])[0], WandbSink)
    monitor, board = _run(tmp_path, logger)
    run_dir = Path(logger.experiment.dir).parent
    summary = {k: logger.experiment.summary[k] for k in logger.experiment.summary.keys()}  # noqa: SIM118 - not a dict
    logger.experiment.finish()

    expected = _tensorboard_images(board.log_dir)
    tags = image_tags(PROJECTIONS, activations=True)
    assert {tag for tag, _ in expected} == set(tags) and {s for _, s in expected} == {0, 4}
    media = run_dir / "files" / "media" / "images"
    files = sorted(media.rglob("*.png"))
    assert len(files) == len(expected)  # one PNG per image tag and image step
    for (tag, step), png in expected.items():
        # W&B names the file <key>_<its own step>_<hash>.png, keys keep their folders
        candidates = [f for f in files if f.relative_to(media).as_posix().startswith(f"{tag}_")]
        assert candidates, tag
        assert any(torch.equal(_pixels(f.read_bytes()), _pixels(png)) for f in candidates), (tag, step)
    # histograms and event texts: the run summary names their types
    assert {f"hdi/{p}/mean" for p in PROJECTIONS} <= set(summary)
    histograms = [k for k in summary if k.startswith("principal_angles_deg/key/")]
    assert histograms and all(dict(summary[k])["_type"] == "histogram" for k in histograms)
    assert dict(summary["diversity_events/saturation_text"])["_type"] == "table-file"
    assert isinstance(summary["diversity_events/saturation"], (int, float))  # the count stays a number
    assert monitor.tracker is not None and monitor.tracker.events


@pytest.mark.slow  # an MLflow store and artifact folder (seconds); CI runs it
def test_mlflow_local_run_holds_the_heatmaps_histograms_and_events(tmp_path):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="hdi", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts"))
    assert isinstance(sinks_for_loggers([logger])[0], MLflowSink)
    monitor, board = _run(tmp_path, logger)

    client = MlflowClient(tracking_uri=uri)
    run_id = logger.run_id

    def walk(path: str | None = None) -> list[str]:
        out = []
        for info in client.list_artifacts(run_id, path):
            out += walk(info.path) if info.is_dir else [info.path]
        return out

    artifacts = walk()
    root = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    expected = _tensorboard_images(board.log_dir)
    assert len(expected) == 2 * len(image_tags(PROJECTIONS, activations=True))
    pngs = [a for a in artifacts if a.startswith("images/") and a.endswith(".png") and "compressed" not in a]
    assert len(pngs) == len(expected)
    for (tag, step), png in expected.items():
        # MLflow's stepped images: images/<key with / as ~>+step+<step>+timestamp+...+<uuid>.png
        key = tag.replace("/", "~")
        mine = [a for a in pngs if a.split("/", 1)[1].startswith(f"{key}+step+{step}+")]
        assert len(mine) == 1, (tag, step, pngs[:4])
        assert torch.equal(_pixels((root / mine[0]).read_bytes()), _pixels(png)), (tag, step)
    histograms = [a for a in artifacts if a.startswith("histograms/principal_angles_deg/key/")]
    assert histograms and all(a.endswith((".json",)) for a in histograms)
    texts = [a for a in artifacts if a.startswith("text/diversity_events/")]
    assert texts and monitor.tracker is not None and monitor.tracker.events
    # the scalars are the TensorBoard ones
    tb_key = scalar_series(read_events(board.log_dir), "hdi/key/mean")
    ml_key = {m.step: m.value for m in client.get_metric_history(run_id, "hdi/key/mean")}
    assert ml_key.keys() == tb_key.keys()
    assert all(ml_key[s] == pytest.approx(tb_key[s], rel=1e-6) for s in tb_key)


def test_scalar_only_logger_gets_a_one_time_note(tmp_path):
    """A scalars-only logger gets the scalars and one MonitoringWarning saying where the pictures go
    (once per logger class and process: a class of its own here)."""

    class ScalarsOnly(CSVLogger):
        pass

    with pytest.warns(MonitoringWarning, match="ScalarsOnly takes scalars only") as caught:
        sinks = sinks_for_loggers([ScalarsOnly(str(tmp_path)), ScalarsOnly(str(tmp_path / "b"))])
    assert [type(s) for s in sinks] == [LoggerSink, LoggerSink]
    assert len([w for w in caught if "takes scalars only" in str(w.message)]) == 1
