"""Prefect pull steps of prefect.yaml, evaluated on the worker when a flow run starts (standard library only:
Prefect imports this module before the working directory is set, so it must come from the installed package).

    pull:
      - alloy.deploy_steps.set_working_directory_from_env:
          variable: ALLOY_HOME

changes into `$ALLOY_HOME` as the WORKER's environment has it (not the deploying machine's, which a
`{{ $ALLOY_HOME }}` placeholder could be filled from), and puts that folder first on `sys.path`, so the flow and
everything it imports come from the worker's copy of the repository (docs/scale-out.md).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def set_working_directory_from_env(variable: str = "ALLOY_HOME", must_contain: str = "flows") -> dict[str, str]:
    """chdir into the directory named by the environment variable `variable` of this (the worker's) process and
    put it first on sys.path; returns {"directory": path} for later steps. Raises naming the variable when it is
    unset or does not name a copy of the repository (a folder with `must_contain` in it)."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        raise RuntimeError(f"pull step set_working_directory_from_env: ${variable} is not set on this worker; start "
                           f"the worker with {variable}=<its copy of the Alloy repository> (docs/scale-out.md)")
    directory = Path(raw).expanduser().resolve()
    if not (directory / must_contain).is_dir():
        raise RuntimeError(f"pull step set_working_directory_from_env: ${variable}={raw} is not a copy of the Alloy "
                           f"repository on this worker (no {must_contain}/ in it)")
    os.chdir(directory)
    if str(directory) not in sys.path[:1]:
        sys.path.insert(0, str(directory))
    return {"directory": str(directory)}
