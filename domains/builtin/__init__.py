"""The built-in domains (13). Each class documents its prompt format, difficulty knob and partial credit."""
from domains.builtin.arithmetic import Addition, DigitSum, MaxList, Multiplication, Subtraction, ToBinary
from domains.builtin.text import Brackets, Caesar, CaseSwap, Copy, CountChar, Reverse, SortDigits

ALL = [Addition, Subtraction, Multiplication, MaxList, DigitSum, ToBinary,
       Reverse, Copy, SortDigits, CaseSwap, Caesar, CountChar, Brackets]

__all__ = [cls.__name__ for cls in ALL] + ["ALL"]
