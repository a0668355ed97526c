"""LightningCLI entry point: every HDIMonitor argument is configurable from YAML.

python examples/lightning_cli.py fit --config configs/demo.yaml
python examples/lightning_cli.py fit --config configs/demo.yaml --trainer.max_steps 100
"""

from lightning.pytorch.cli import LightningCLI


def main() -> None:
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
