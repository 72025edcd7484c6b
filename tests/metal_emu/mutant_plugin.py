"""pytest plugin used by mutants.py: makes tests.metal_emu.load(path) return the mutant named
by RLX_EMU_MUTANT_FILE whenever `path` is RLX_EMU_MUTANT_TARGET. Test modules import `load`
after plugins are configured, so they get the patched function."""

import os
from pathlib import Path


def pytest_configure(config):
    from tests import metal_emu
    from tests.metal_emu.mutants import resolve

    target = Path(os.environ["RLX_EMU_MUTANT_TARGET"])
    mutant = Path(os.environ["RLX_EMU_MUTANT_FILE"])
    real_load = metal_emu.load

    def load(path):
        if resolve(path) == target:
            return metal_emu.load_source(mutant.read_text(), mutant.stem)
        return real_load(path)

    metal_emu.load = load
