"""Prefect pull steps of prefect.yaml, evaluated on the worker when a flow run starts (standard library only:
Prefect imports this module before the working directory is set, so it must come from the installed package).

    pull:
      - alloy.deploy_steps.set_working_directory_from_env:
          variable: ALLOY_HOME

changes into `$ALLOY_HOME` as the WORKER's environment has it (not the deploying machine's, which a
`{{ $ALLOY_HOME }}` placeholder could be filled from), and puts that folder first on `sys.path`, so the flow and
everything it imports come from the worker's copy of the repository (docs/scale-out.md).

Without `$ALLOY_HOME`, a worker started in a copy of the repository (a stock `prefect worker start --pool
alloy-local` typed in it, as Prefect's docs teach) uses that copy: the flow run is the worker's child, started in a
temporary folder, so the worker's folder is the parent process's working directory (Linux `/proc`), or the `$PWD`
the shell exported. Which one is used is logged; a worker started anywhere else keeps the error naming the variable.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("alloy.deploy_steps")


def worker_directories() -> list[tuple[str, Path]]:
    """(where it came from, folder) candidates for the worker's own working directory, best first."""
    out = []
    try:
        out.append(("the worker's working directory", Path(os.readlink(f"/proc/{os.getppid()}/cwd"))))
    except OSError:  # not Linux, or the parent is gone
        pass
    if os.environ.get("PWD"):
        out.append(("$PWD", Path(os.environ["PWD"])))
    return out


def set_working_directory_from_env(variable: str = "ALLOY_HOME", must_contain: str = "flows") -> dict[str, str]:
    """chdir into the directory named by the environment variable `variable` of this (the worker's) process, or,
    when it is unset, the folder the worker was started in (see the module docstring), and put it first on sys.path;
    returns {"directory": path} for later steps. Raises naming the variable when it is set to something that is not
    a copy of the repository (a folder with `must_contain` in it), or unset on a worker started elsewhere."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        found = [(what, d) for what, d in worker_directories() if (d / must_contain).is_dir()]
        if not found:
            raise RuntimeError(f"pull step set_working_directory_from_env: ${variable} is not set on this worker and "
                               f"the worker was not started in a copy of the Alloy repository (no {must_contain}/ in "
                               f"{[str(d) for _, d in worker_directories()]}); start the worker in the repository, "
                               f"or with {variable}=<its copy of the Alloy repository> (docs/scale-out.md)")
        what, raw = found[0][0], str(found[0][1])
        log.warning("pull step: $%s is not set; using %s, %s (set %s to choose another copy)", variable, what, raw,
                    variable)
        print(f"alloy pull step: ${variable} is not set; using {what}, {raw}", file=sys.stderr, flush=True)
    directory = Path(raw).expanduser().resolve()
    if not (directory / must_contain).is_dir():
        raise RuntimeError(f"pull step set_working_directory_from_env: ${variable}={raw} is not a copy of the Alloy "
                           f"repository on this worker (no {must_contain}/ in it)")
    os.chdir(directory)
    if str(directory) not in sys.path[:1]:
        sys.path.insert(0, str(directory))
    return {"directory": str(directory)}
