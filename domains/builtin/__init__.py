"""The built-in domains (18). Each class documents its prompt format, difficulty knob and partial credit."""
from domains.builtin.arithmetic import Addition, DigitSum, MaxList, Multiplication, Subtraction, ToBinary
from domains.builtin.positional import Dedupe, Interleave, Rotate, SwapPairs
from domains.builtin.text import Brackets, Caesar, CaseSwap, Copy, CountChar, Reverse, SortDigits
from domains.tools import ToolAdd

ALL = [Addition, Subtraction, Multiplication, MaxList, DigitSum, ToBinary,
       Reverse, Copy, SortDigits, CaseSwap, Caesar, CountChar, Brackets,
       Rotate, SwapPairs, Interleave, Dedupe, ToolAdd]

__all__ = [cls.__name__ for cls in ALL] + ["ALL"]
