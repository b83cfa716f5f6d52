"""Lightning on infinity: the Trainer's strategy (`trainer.py`), Fabric's (`fabric.py`), their
precision plugins (`precision.py`), the translation of DeepSpeedStrategy's arguments into a
config (`config.py`), checkpoint conversion (`checkpoints.py`, `single_file.py`).
`strategy.py` registers the strategy names and is `infinity.lightning`, the public name."""
