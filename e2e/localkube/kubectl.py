"""kubectl with the cluster's admin kubeconfig; failures raise with kubectl's own message."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from typing import Any

import yaml

from e2e.localkube.binaries import tool
from e2e.localkube.settings import Layout


class KubectlError(RuntimeError):
    pass


class Kubectl:
    def __init__(self, layout: Layout) -> None:
        self.argv = [tool("kubectl"), "--kubeconfig", str(layout.kubeconfig)]

    def run(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        try:
            result = subprocess.run(
                [*self.argv, *args], input=input, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise KubectlError(f"`kubectl {' '.join(args)}` did not finish within {timeout:.0f} s") from exc
        if check and result.returncode != 0:
            raise KubectlError(
                f"`kubectl {' '.join(args)}` exited with {result.returncode}: {result.stderr.strip()}"
            )
        return result.stdout

    def ok(self, *args: str) -> bool:
        try:
            self.run(*args, timeout=10)
            return True
        except KubectlError:
            return False

    def apply(self, docs: Iterable[dict[str, Any]]) -> None:
        """Server-side apply of `docs` (kubectl's field manager)."""
        self.run("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(list(docs), sort_keys=False))

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))
