"""``hylo bench``: speed on the GPU against the hardware's floors (``run``), with the benchmark models' shapes
(``shapes``), the floors (``floors``), steady-state timing (``steps``), HF transformers' side (``hf``) and the
tensor-parallel runs (``tp``)."""
