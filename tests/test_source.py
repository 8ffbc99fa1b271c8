"""The package's source reads in a 140-column editor: the formatting the code was written to
(black -l 140 -S on what exceeds it), kept so a line over the limit is caught where it is added."""

from pathlib import Path

import dpsm_ray

LIMIT = 140


def test_every_package_line_fits_140_columns():
    package = Path(dpsm_ray.__file__).parent
    long = [f"{path.relative_to(package)}:{number} ({len(line)} characters)"
            for path in sorted(package.rglob("*.py"))
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > LIMIT]
    assert long == [], f"{len(long)} lines over {LIMIT} characters: reflow them (black -l {LIMIT} -S --line-ranges=N-N FILE)"
