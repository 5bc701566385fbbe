"""The OPD merge as Prefect flows: teacher servers up → distill the student → register it.

`distill_stage(ctx, ...)` is the pipeline's subflow (after the specialists, with the base checkpoint as the
student's start and {domain: specialist checkpoint dir}); domains in `teachers.external` use those URLs instead.
`distill(...)` is the same with plain JSON parameters: the `alloy-distill/default` deployment.
"""
from __future__ import annotations

from prefect import flow

from infra.config import refuse_secret_overrides
from tasks.context import RunContext, open_context
from tasks.distill import register_student, train_student
from tasks.teachers import serve_teachers


@flow(name="alloy-distill-stage", validate_parameters=False)
def distill_stage(ctx: RunContext, student_init: str, specialists: dict[str, str]) -> dict:
    """Returns the student summary: `student_dir`, `student_checkpoint`, `registered_model`, `n_teachers`,
    `throughput`, per-teacher totals and the in-training evals."""
    fleet = serve_teachers(ctx, specialists, student_init)
    try:
        student = train_student(ctx, student_init, fleet.endpoints())
        student["teacher_restarts"] = {s["name"]: s["restarts"] for s in fleet.status()}
    finally:
        fleet.stop()  # the teachers are only needed while the student trains
    student["n_teachers"] = len(fleet.endpoints())
    student["registered_model"] = register_student(ctx, student)
    return student


@flow(name="alloy-distill", log_prints=True)
def distill(config: str, student_init: str, teachers: dict[str, str], overrides: list[str] | None = None,
            parent_run_id: str | None = None) -> dict:
    """Distill `teachers` ({domain: specialist HF dir}; domains in the config's `teachers.external` may be
    omitted) into a student started from `student_init`, for CONFIG. Logs under `parent_run_id` when given.
    Secrets are refused in `overrides`: the worker's environment carries them (ALLOY_ENGINE_API_KEY, ...)."""
    refuse_secret_overrides(overrides, "flow alloy-distill, parameter `overrides`")
    ctx = open_context(config, overrides or [], parent_run_id=parent_run_id)
    status = "FAILED"
    try:
        out = distill_stage(ctx, student_init, teachers)
        status = "FINISHED"
        return out
    finally:
        if parent_run_id is None:  # our own parent run; someone else's stays open for them
            ctx.tracker.end(status)
