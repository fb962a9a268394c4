"""`python -m e2e.localkube up --dir DIR`: the cluster from nothing, in dependency order, each step
waited for until it is ready; what was started or changed is recorded in DIR/state.json as it goes, so
that `down` undoes a failed `up` too (and `up` calls it itself when a step fails)."""

from __future__ import annotations

import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from e2e.localkube import (
    binaries,
    certs,
    chart,
    control_plane,
    dns,
    host,
    images,
    lock,
    netpol,
    node,
    prometheus,
    s3,
    storage,
)
from e2e.localkube.down import teardown
from e2e.localkube.kubectl import Kubectl
from e2e.localkube.processes import wait_until
from e2e.localkube.settings import (
    EXTRA_MAJORS,
    NODE_NAME,
    OPERATOR_NAMESPACE,
    POSTGRES_MAJOR,
    PROJECT_IMAGE,
    RELEASE,
    STORAGE_CLASS,
    Layout,
    Settings,
)
from e2e.localkube.state import State

NODE_READY_TIMEOUT = 120.0


@dataclass(frozen=True)
class Options:
    operator: bool = True
    image_archive: Path | None = None  # a prebuilt OCI archive of the project's image
    image: str = PROJECT_IMAGE
    postgres_major: int = POSTGRES_MAJOR
    extra_majors: str = EXTRA_MAJORS  # the Dockerfile's PG_EXTRA_MAJORS ("default": its own)
    keep_on_failure: bool = False
    prometheus: bool = False  # also a Prometheus scraping the pods as the chart's PodMonitors would


def say(message: str) -> None:
    print(f"localkube: {message}", flush=True)


def cluster_running(directory: Path) -> list[str]:
    """The components of the cluster in `directory` that still run."""
    state = State.load(Layout(directory))
    return [process.name for process in state.running()]


def claim_machine(fd: int, directory: Path, settings: Settings) -> None:
    """Refuse when another cluster owns the machine, this one runs already, or the network is taken."""
    owner = lock.owner(fd)
    if owner is not None and owner.exists():
        running = cluster_running(owner)
        if running:
            where = "already runs here" if owner == directory else f"runs from {owner}"
            raise lock.Busy(
                f"a localkube cluster {where} ({', '.join(running)}); only one can run on a machine: "
                f"`python -m e2e.localkube down --dir {owner}` first"
            )
        bring_down_remains(fd, owner)
    if host.bridge_exists(settings.bridge):
        raise lock.Busy(
            f"the bridge {settings.bridge} exists (another cluster, or one whose `down` did not finish): "
            f"`python -m e2e.localkube down --dir {owner or 'DIR'}`, or `ip link del {settings.bridge}`"
        )
    taken = []
    for name, port in settings.ports.all().items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"{port} ({name})")
    if taken:
        raise lock.Busy(f"ports taken: {', '.join(taken)}; choose others with --port-base")


def bring_down_remains(fd: int, owner: Path) -> None:
    """The owner's processes are gone but it never ran `down` (its run was killed): its bridge, cgroups,
    mounts and rules are still there, and only its state.json knows them. Undo them as `down` would."""
    layout = Layout(owner)
    if not layout.state.exists():
        return
    say(f"the cluster of {owner} stopped without `down`: bringing down what it left")
    left = teardown(layout, State.load(layout))
    if left:
        raise lock.Busy(f"the cluster of {owner} left what `down` could not remove: {', '.join(left)}")
    lock.set_owner(fd, None)


def fresh_directory(directory: Path) -> None:
    """DIR must be new, empty, or a former cluster's (its state.json there, nothing running): then it is
    emptied. Anything else is refused rather than deleted."""
    if directory.exists() and any(directory.iterdir()):
        if not Layout(directory).state.exists():
            raise SystemExit(f"{directory} is not empty and holds no localkube cluster: choose another --dir")
        if cluster_running(directory):
            raise SystemExit(
                f"{directory} holds a running cluster: `python -m e2e.localkube down --dir {directory}`"
            )
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)


def node_ready(kubectl: Kubectl) -> bool:
    conditions = kubectl.json("get", "node", NODE_NAME)["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def up(directory: Path, settings: Settings, options: Options) -> None:
    started = time.monotonic()
    if options.image_archive is not None and not options.image_archive.is_file():
        raise FileNotFoundError(f"--image-archive {options.image_archive}: no such file")
    binaries.check_host()
    bin_dir = binaries.kubernetes_bin()
    netpol_bin = binaries.network_policy_bin()
    layout = Layout(directory)
    with lock.held(timeout=10) as fd:
        claim_machine(fd, directory, settings)
        fresh_directory(directory)
        lock.set_owner(fd, directory)
        state = State(layout)
        state.update(
            dir=str(directory), settings=settings.to_json(), binDir=str(bin_dir),
            versions=binaries.versions(bin_dir), host=host.read_sysctls(), ready=False, operator=None,
        )  # fmt: skip
        try:
            start_cluster(layout, settings, options, state, bin_dir, netpol_bin)
        except BaseException as exc:
            say(f"up failed: {exc}")
            if not options.keep_on_failure:
                say("bringing down what was started (logs kept in DIR/logs)")
                teardown(layout, state)
                lock.set_owner(fd, None)
            raise
    state.update(ready=True, upSeconds=round(time.monotonic() - started, 1))
    report(layout, settings, state, options)


def start_cluster(
    layout: Layout, settings: Settings, options: Options, state: State, bin_dir: Path, netpol_bin: Path
) -> None:
    for folder in (layout.pki, layout.config, layout.logs):
        folder.mkdir(parents=True, exist_ok=True)
    say(
        f"host: bridge {settings.bridge} {settings.node_ip}/{settings.prefix_length}, cgroup root {settings.cgroup_root}"
    )
    state.update(bridge=settings.bridge)
    host.set_up_network(settings)
    host.make_cgroup_root(settings)
    certs.make_pki(layout, settings)
    certs.write_kubeconfigs(layout, settings)
    kubectl = Kubectl(layout)

    for start in (control_plane.etcd, control_plane.apiserver):
        state.add_process(start(layout, settings, bin_dir))
    say(f"control plane: etcd, kube-apiserver at {settings.api_url}")
    # The API server calls the kubelet (logs, exec, port-forward) as this user.
    kubectl.run(
        "create", "clusterrolebinding", "localkube:apiserver-kubelet-client",
        "--clusterrole", "system:kubelet-api-admin", "--user", certs.APISERVER_KUBELET_CLIENT.user,
    )  # fmt: skip
    for start in (control_plane.controller_manager, control_plane.scheduler):
        state.add_process(start(layout, settings, bin_dir))
    say("control plane: kube-controller-manager, kube-scheduler")

    state.add_process(node.containerd(layout, settings))
    images.node_images(layout)
    state.add_process(node.kubelet(layout, settings, bin_dir))
    wait_until("the node registered", lambda: kubectl.ok("get", "node", NODE_NAME), timeout=NODE_READY_TIMEOUT,
               log=layout.log("kubelet"))  # fmt: skip
    wait_until(
        f"node {NODE_NAME} Ready",
        lambda: node_ready(kubectl),
        timeout=NODE_READY_TIMEOUT,
        log=layout.log("kubelet"),
    )
    state.add_process(node.kube_proxy(layout, settings, bin_dir))
    state.add_process(netpol.kube_router(layout, settings, netpol_bin, kubectl))
    say(f"node {NODE_NAME} Ready: containerd, kubelet, kube-proxy, kube-router (NetworkPolicies)")

    state.add_process(dns.coredns(layout, settings, bin_dir, kubectl))
    state.add_process(storage.local_path_provisioner(layout, bin_dir, kubectl))
    wait_until(
        f"the default StorageClass {STORAGE_CLASS}",
        lambda: kubectl.ok("get", "storageclass", STORAGE_CLASS),
        timeout=30,
    )
    say(f"add-ons: CoreDNS at {settings.node_ip}:53, StorageClass {STORAGE_CLASS} (default)")
    process, store = s3.s3_server(layout, settings, kubectl)
    state.add_process(process)
    state.update(
        s3={k: v for k, v in store.items() if k != "secretAccessKey"}
        | {"secret": "default/pgherd-e2e-s3", "caSecret": "default/pgherd-e2e-s3-ca"}
    )
    say(
        f"S3 server: {store['endpoint']} (its CA: {store['caFile']}), bucket {store['bucket']} ({layout.s3_json})"
    )
    # Pods of `default` need its ServiceAccount, which the controller-manager makes.
    wait_until(
        "the default ServiceAccount", lambda: kubectl.ok("get", "serviceaccount", "default"), timeout=60
    )
    write_env(layout, bin_dir)
    if options.prometheus:
        state.add_process(prometheus.start_prometheus(layout))
        say(f"Prometheus: {prometheus.info_file(layout).read_text().strip()}")

    if not options.operator:
        return
    # The chart's default postgresImage is the operator's image (it carries the majors the scenarios run).
    postgres_image = options.image
    archive = options.image_archive or images.build_project_image(
        options.image, options.postgres_major, options.extra_majors
    )
    major_tag = f"{options.image}-pg{options.postgres_major}"
    say(f"image: importing {archive} as {options.image} and {major_tag}")
    images.import_archive(layout, archive, major_tag, options.image)
    state.update(image=options.image, postgresImage=postgres_image, postgresMajor=options.postgres_major)
    say(
        f"chart: helm install {RELEASE} charts/pgherd --namespace {OPERATOR_NAMESPACE} --create-namespace -f {layout.values}"
    )
    chart.install(layout, options.image, kubectl)
    state.update(operator={"release": RELEASE, "namespace": OPERATOR_NAMESPACE})


def write_env(layout: Layout, bin_dir: Path) -> None:
    layout.env.write_text(
        f"export KUBECONFIG={layout.kubeconfig}\n"
        f"export CONTAINER_RUNTIME_ENDPOINT={layout.cri_endpoint}\n"
        f"export PATH={binaries.tool('kubectl').rsplit('/', 1)[0]}:{bin_dir}:$PATH\n"
    )


def report(layout: Layout, settings: Settings, state: State, options: Options) -> None:
    names = ", ".join(process.name for process in state.processes())
    print(
        f"""
localkube is up in {state.data.get("upSeconds")} s ({state.data.get("versions")})
  processes:  {names}
  API server: {settings.api_url}   audit log: {layout.audit_log}
  node:       {NODE_NAME} ({settings.node_ip}), pods on {settings.bridge} {settings.pod_cidr}, services {settings.service_cidr}
  storage:    default StorageClass {STORAGE_CLASS} (local-path-provisioner, volumes in {layout.volumes})
  S3:         {layout.s3_json} (keys also in Secret default/pgherd-e2e-s3, its CA in default/pgherd-e2e-s3-ca)
  Prometheus: {prometheus.info_file(layout) if options.prometheus else "not started (--prometheus starts it)"}
  operator:   {"helm release " + RELEASE + " in " + OPERATOR_NAMESPACE + ", values " + str(layout.values) if options.operator else "not installed (--no-operator)"}
Use it:
  export KUBECONFIG={layout.kubeconfig}     # or: source {layout.env}
  kubectl get nodes,pods -A
  kubectl apply -f examples/cluster-minimal.yaml && kubectl get pgc -w
Logs: {layout.logs}/   Stop and remove it: python -m e2e.localkube down --dir {layout.root}""",
        flush=True,
    )
