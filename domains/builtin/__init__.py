"""The built-in domains (26). Each class documents its prompt format, difficulty knob and partial credit."""
from domains.builtin.arithmetic import Addition, DigitSum, MaxList, Multiplication, Subtraction, ToBinary
from domains.builtin.long import CycleWalk, PrefixMod, Record, RleExpand
from domains.builtin.positional import Dedupe, Interleave, Rotate, SwapPairs
from domains.builtin.text import Brackets, Caesar, CaseSwap, Copy, CountChar, Reverse, SortDigits
from domains.builtin.tool_tree import ToolChain, ToolFiles
from domains.builtin.tool_code import ToolCode
from domains.builtin.tool_add import ToolAdd
from domains.builtin.tool_long import ToolLong

ALL = [Addition, Subtraction, Multiplication, MaxList, DigitSum, ToBinary,
       Reverse, Copy, SortDigits, CaseSwap, Caesar, CountChar, Brackets,
       Rotate, SwapPairs, Interleave, Dedupe, PrefixMod, CycleWalk, RleExpand, Record, ToolAdd, ToolLong, ToolFiles, ToolChain, ToolCode]

__all__ = [cls.__name__ for cls in ALL] + ["ALL"]
