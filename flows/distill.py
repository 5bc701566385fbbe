"""The OPD merge as a Prefect (sub)flow: teacher servers up → distill the student → register it.

Called from the pipeline after the specialists stage with the base checkpoint (the student's start) and
{domain: specialist checkpoint dir}. Domains listed in `teachers.external` use those URLs instead.
"""
from __future__ import annotations

from prefect import flow

from tasks.context import RunContext
from tasks.distill import register_student, train_student
from tasks.teachers import serve_teachers


@flow(name="alloy-distill", validate_parameters=False)
def distill(ctx: RunContext, student_init: str, specialists: dict[str, str]) -> dict:
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
