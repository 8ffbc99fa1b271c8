"""What every benchmark here ends with: its record as one JSON line on stdout, and, with
``--json-out FILE``, the same line written to FILE whole or not at all (a temporary file renamed)."""

import json
import os


def emit(record: dict, json_out: str | None) -> None:
    line = json.dumps(record)
    print(line)
    if json_out:
        with open(json_out + ".tmp", "w") as file:
            file.write(line + "\n")
        os.replace(json_out + ".tmp", json_out)
