"""The least an operator can do for a spec change: the reference that bench/operator_scale.py measures
beside pgherd, in the same run, on the same API server and objects.

    python bench/minimal_status_writer.py KUBECONFIG NAMESPACE

It watches the namespace's PostgresClusters and, for each new generation, merge-patches
status.observedGeneration alone (32 writes in flight at most, as pgherd's connection pool). It prints
"watching" once its watch is open. Nothing else: no engine, no owned objects, no conditions. What it
costs the API server per change is what any operator's status write costs at least with pgherd's CRD.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from typing import Any

import aiohttp
import yaml

IN_FLIGHT = 32


async def main(kubeconfig: str, namespace: str) -> None:
    with open(kubeconfig) as file:
        config = yaml.safe_load(file)
    cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
    tls = ssl.create_default_context(cafile=cluster["certificate-authority"])
    base = f"{cluster['server']}/apis/pgherd.io/v1alpha1/namespaces/{namespace}/postgresclusters"
    headers = {"Authorization": f"Bearer {user['token']}", "Accept": "application/json"}
    seats = asyncio.Semaphore(IN_FLIGHT)
    written: dict[str, int] = {}
    pending: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(ssl=tls, limit=IN_FLIGHT + 1)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def write(name: str, generation: int) -> None:
            async with (
                seats,
                session.patch(
                    f"{base}/{name}/status",
                    data=json.dumps({"status": {"observedGeneration": generation}}),
                    headers={"Content-Type": "application/merge-patch+json"},
                ) as response,
            ):
                await response.read()
                if response.status >= 300:  # said in the bench's log; that cluster never catches up
                    print(f"{name}: status write answered {response.status}", file=sys.stderr, flush=True)

        async with session.get(base) as response:
            listing: dict[str, Any] = await response.json()
        version = listing["metadata"]["resourceVersion"]
        for item in listing["items"]:
            written[item["metadata"]["name"]] = int(item["metadata"]["generation"])
        params = {"watch": "1", "allowWatchBookmarks": "true"}
        unbounded = aiohttp.ClientTimeout(total=None)
        while True:
            async with session.get(
                base, params={**params, "resourceVersion": version}, timeout=unbounded
            ) as response:
                print("watching", flush=True)
                async for line in response.content:
                    event = json.loads(line)
                    meta = event["object"]["metadata"]
                    version = meta["resourceVersion"]
                    if event["type"] != "MODIFIED":
                        continue
                    name, generation = meta["name"], int(meta["generation"])
                    if written.get(name, 0) < generation:
                        written[name] = generation
                        task = asyncio.ensure_future(write(name, generation))
                        pending.add(task)
                        task.add_done_callback(pending.discard)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
