"""Kubernetes' rules for names, labels and tolerations (apimachinery's validation), stdlib only.

The launcher builds its objects' names to pass them (`kubernetes_objects.py`); a run's settings are held to them
before anything is created (`core.config`), in processes that never import the Kubernetes client: the DAG file
at parse time, the prepare task, every worker loading its config. Patterns are matched whole (`fullmatch`).
"""

from __future__ import annotations

import re

MAX_NAME = 63  # a DNS-1123 label; also a label's name and its value
DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"  # a namespace, a pod's hostname, a Service's name
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"  # a service account, a label key's prefix
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"  # a label key after its optional `<prefix>/`
LABEL_VALUE = rf"({LABEL_NAME})?"  # a label's value: a name or empty
TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def is_dns_label(text: str) -> bool:
    return re.fullmatch(DNS_LABEL, text) is not None


def is_dns_subdomain(text: str) -> bool:
    return re.fullmatch(DNS_SUBDOMAIN, text) is not None


def is_label(key: str, value: str) -> bool:
    """Whether `key: value` is a valid label (a node selector's entry): `[<DNS subdomain>/]<name>`, and a value."""
    prefix, _, name = key.rpartition("/")
    return ((not prefix or is_dns_subdomain(prefix)) and re.fullmatch(LABEL_NAME, name) is not None
            and re.fullmatch(LABEL_VALUE, value) is not None)


def is_label_value(text: str) -> bool:
    return re.fullmatch(LABEL_VALUE, text) is not None
