"""Where model-written commands run: `sandbox.runner` parses a tool call, checks its paths and runs it in a confined
child process (namespaces, rlimits, a dropped uid; the child's side and its supervisor are `sandbox.supervisor`;
which arguments name files, `sandbox.flags`);
`sandbox.confine` builds the kernel layers applied last before exec (Landlock, seccomp). Imports nothing heavy (no
torch): every tool call of every stage goes through it.
"""
