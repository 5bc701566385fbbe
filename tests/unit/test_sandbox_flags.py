"""`sandbox.flags.file_operands`: which arguments of `ls`, `cat`, `grep` name files, on hand-listed argument vectors
(the red-team suite, tests/reliability/test_sandbox_escape.py, runs the same forms through `run_tool`)."""
import pytest

from sandbox.flags import CAT, GREP, LS, FlagRefused, file_operands

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec, args, files", [
    (GREP, ["-h", "k=", "data/a", "data/b"], ["k=", "data/a", "data/b"]),  # the pattern is an operand too
    (GREP, ["--file=/etc/x", "notes"], ["/etc/x", "notes"]),
    (GREP, ["--file", "/etc/x", "notes"], ["/etc/x", "notes"]),
    (GREP, ["-f/etc/x", "notes"], ["/etc/x", "notes"]),
    (GREP, ["-inf/etc/x", "notes"], ["/etc/x", "notes"]),  # clustered: the value is the rest of the cluster
    (GREP, ["-if", "/etc/x", "notes"], ["/etc/x", "notes"]),
    (GREP, ["--exclude-from=/etc/x", "-r", "k"], ["/etc/x", "k"]),
    (GREP, ["-e", "../x", "-A2", "-B", "3", "--max-count=1", "notes"], ["notes"]),  # values that are not files
    (GREP, ["notes", "-f", "/etc/x"], ["notes", "/etc/x"]),  # flags after operands (GNU getopt permutes)
    (GREP, ["-e", "x", "--", "-f/etc/x"], ["-f/etc/x"]),  # after --, an operand
    (GREP, ["x", "@/etc/x"], ["/etc/x", "x", "@/etc/x"]),  # a response file names its target
    (GREP, ["-e", "@/etc/x", "n"], ["/etc/x", "n"]),
    (CAT, ["-n", "-", "a"], ["-", "a"]),
    (LS, ["-la", "--hide=x", "-I", "y", "sub"], ["sub"]),
    (LS, ["--color=auto"], []),
])
def test_file_operands(spec, args, files):
    assert file_operands(spec, args) == files


@pytest.mark.parametrize("spec, args, match", [
    (GREP, ["-R", "x"], "flag -R"),  # follows every symlink
    (GREP, ["--dereference-recursive", "x"], "--dereference-recursive"),
    (GREP, ["--exclude-f=/etc/x", "x"], "--exclude-f"),  # a prefix GNU getopt would accept: exact names only
    (CAT, ["--opt=/etc/x"], "--opt"),
    (LS, ["-L"], "flag -L"),
    (LS, ["-l/etc"], "flag -/"),
    (LS, ["--all=x"], "takes no value"),
    (GREP, ["x", "-f"], "needs a value"),
    (GREP, ["x", "--file"], "needs a value"),
])
def test_refused_flags_name_themselves(spec, args, match):
    with pytest.raises(FlagRefused, match=match):
        file_operands(spec, args)
