"""`python -m alloy.prefect_compat ARGS…` = `prefect ARGS…` with one FastAPI compatibility fix, for the Prefect server
that `alloy up` starts.

Why: Prefect 3.8.8's client sends optional body fields as explicit JSON nulls (`{"limit": null, "offset": null}`,
e.g. `read_workers_for_work_pool`, which `prefect deploy` calls after creating each deployment). The server declares
them `limit: int = Body(None)`. FastAPI 0.154 (the newest that Prefect 3.8.8's server starts with; see
pyproject.toml) validates an explicit null against `int` and answers 422, so `prefect deploy --all` stops after its
first deployment. Older FastAPI treated a null body field like a missing one (its default). This shim restores that
for embedded body fields that are not required, in the server process only; required fields are untouched.
`prefect server start` runs uvicorn in-process (foreground), so the patch applies to the real server.
"""
from __future__ import annotations

import sys


def patch_fastapi_null_body_fields() -> None:
    """Drop top-level JSON nulls of optional embedded body fields before FastAPI validates them (idempotent)."""
    import fastapi.dependencies.utils as fu

    if getattr(fu.request_body_to_args, "_alloy_patched", False):
        return
    original = fu.request_body_to_args

    async def request_body_to_args(body_fields, received_body, embed_body_fields):
        if embed_body_fields and isinstance(received_body, dict):
            required = {fu.get_validation_alias(f) for f in body_fields if f.field_info.is_required()}
            received_body = {k: v for k, v in received_body.items() if v is not None or k in required}
        return await original(body_fields, received_body, embed_body_fields)

    request_body_to_args._alloy_patched = True
    fu.request_body_to_args = request_body_to_args


def main() -> None:
    patch_fastapi_null_body_fields()
    from prefect.cli import app

    sys.argv[0] = "prefect"
    sys.exit(app())


if __name__ == "__main__":
    main()
