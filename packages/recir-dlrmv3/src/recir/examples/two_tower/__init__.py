"""A second model through RecIR's libraries: `python -m recir.examples.two_tower.train` (shipped by the
recir-dlrmv3 distribution; the model and loop are user code, not recir-dlrmv3's)."""
