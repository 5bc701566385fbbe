"""Verifiable task domains: seeded prompt generators with disjoint train/val/eval splits, verifiers with rewards in
[0, 1], and a plugin interface for domains defined outside the repo (see domains/README.md)."""
from domains.base import Domain, Example
from domains.registry import BUILTIN, DomainLoadError, list_domains, load_domain

__all__ = ["BUILTIN", "Domain", "DomainLoadError", "Example", "list_domains", "load_domain"]
