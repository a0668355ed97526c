"""Quick tier: one module (or one package's modules together) against independent references; `tests/unit/<package>/` mirrors `hdi_monitor/<package>/`."""
