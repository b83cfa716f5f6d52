"""Lightning's strategy on infinity (`strategy.py`) and its single-file checkpoint conversion
(`single_file.py`); `infinity.lightning` is the strategy module's public name."""
