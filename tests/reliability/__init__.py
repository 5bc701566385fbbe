"""Reliability and security suite (issue 8): faults survived, bad input refused, secrets kept, nothing lost.

docs/reliability.md lists every fault tried, its outcome and the test that proves it.
"""
