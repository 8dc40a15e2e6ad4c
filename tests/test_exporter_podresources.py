"""GPU -> container labels from the kubelet's pod-resources API, served by a real gRPC server on a
unix socket in place of the kubelet (there is no kubelet on these machines). Its answers are
encoded by protobuf's own library from the API's message definitions, independently of the
exporter's hand-written decoder."""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from exporters.backends.simulated import SimulatedBackend
from exporters.collector import GpuSource
from exporters.fields import load_fields
from exporters.model import DeviceInfo
from exporters.podresources import Allocation, owners_by_gpu, parse_list_response, resolve
from inferwatch import contract as c
from tests.fixtures.gpu_exporter import serve_in_thread

F = descriptor_pb2.FieldDescriptorProto


def _api() -> dict[str, type]:
    """The messages of k8s.io/kubelet/pkg/apis/podresources/v1/api.proto that List returns."""
    fd = descriptor_pb2.FileDescriptorProto(name="podresources_v1_test.proto", package="v1", syntax="proto3")

    def msg(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = fd.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    msg("NUMANode", ("ID", 1, F.TYPE_INT64, opt, ""))
    msg("TopologyInfo", ("nodes", 1, F.TYPE_MESSAGE, rep, ".v1.NUMANode"))
    msg(
        "ContainerDevices",
        ("resource_name", 1, F.TYPE_STRING, opt, ""),
        ("device_ids", 2, F.TYPE_STRING, rep, ""),
        ("topology", 3, F.TYPE_MESSAGE, opt, ".v1.TopologyInfo"),
    )
    msg(
        "ContainerMemory",
        ("memory_type", 1, F.TYPE_STRING, opt, ""),
        ("size", 2, F.TYPE_UINT64, opt, ""),
    )
    msg("CDIDevice", ("name", 1, F.TYPE_STRING, opt, ""))
    msg(
        "ClaimResource",
        ("cdi_devices", 1, F.TYPE_MESSAGE, rep, ".v1.CDIDevice"),
        ("driver_name", 2, F.TYPE_STRING, opt, ""),
        ("pool_name", 3, F.TYPE_STRING, opt, ""),
        ("device_name", 4, F.TYPE_STRING, opt, ""),
    )
    msg(
        "DynamicResource",
        ("claim_name", 2, F.TYPE_STRING, opt, ""),
        ("claim_namespace", 3, F.TYPE_STRING, opt, ""),
        ("claim_resources", 4, F.TYPE_MESSAGE, rep, ".v1.ClaimResource"),
    )
    msg(
        "ContainerResources",
        ("name", 1, F.TYPE_STRING, opt, ""),
        ("devices", 2, F.TYPE_MESSAGE, rep, ".v1.ContainerDevices"),
        ("cpu_ids", 3, F.TYPE_INT64, rep, ""),
        ("memory", 4, F.TYPE_MESSAGE, rep, ".v1.ContainerMemory"),
        ("dynamic_resources", 5, F.TYPE_MESSAGE, rep, ".v1.DynamicResource"),
    )
    msg(
        "PodResources",
        ("name", 1, F.TYPE_STRING, opt, ""),
        ("namespace", 2, F.TYPE_STRING, opt, ""),
        ("containers", 3, F.TYPE_MESSAGE, rep, ".v1.ContainerResources"),
    )
    msg("ListPodResourcesResponse", ("pod_resources", 1, F.TYPE_MESSAGE, rep, ".v1.PodResources"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))
        for name in ("ListPodResourcesResponse",)
    }


Response = _api()["ListPodResourcesResponse"]
DEVICES = SimulatedBackend(gpus=3).init()  # deterministic UUIDs, as the exporter's own backend will have


def allocation() -> bytes:
    r = Response()
    llm = r.pod_resources.add(name="llm-7d9f-x2k4", namespace="serving")
    triton = llm.containers.add(name="triton", cpu_ids=[2, 3])
    triton.memory.add(memory_type="memory", size=2**30)
    gpu = triton.devices.add(resource_name="nvidia.com/gpu", device_ids=[DEVICES[0].uuid])
    gpu.topology.nodes.add(ID=0)
    llm.containers.add(name="log-shipper")  # no devices
    # GPU 1 is time-sliced between two pods: no single owner, so no pod labels
    for pod, replica in (("batch-a", 0), ("batch-b", 1)):
        p = r.pod_resources.add(name=pod, namespace="jobs")
        p.containers.add(name="worker").devices.add(
            resource_name="nvidia.com/gpu", device_ids=[f"{DEVICES[1].uuid}::{replica}"]
        )
    other = r.pod_resources.add(name="nic-user", namespace="net")
    other.containers.add(name="app").devices.add(
        resource_name="example.com/nic", device_ids=[DEVICES[2].uuid]
    )
    mig = r.pod_resources.add(name="mig-user", namespace="jobs")
    mig.containers.add(name="w").devices.add(
        resource_name="nvidia.com/mig-1g.10gb", device_ids=["MIG-0a1b2c3d-0000-0000-0000-000000000000"]
    )
    return r.SerializeToString()


def test_decoder_reads_the_kubelets_answer() -> None:
    allocs = parse_list_response(allocation())
    assert [(a.device_id, a.owner) for a in allocs] == [
        (DEVICES[0].uuid, ("serving", "llm-7d9f-x2k4", "triton")),
        (f"{DEVICES[1].uuid}::0", ("jobs", "batch-a", "worker")),
        (f"{DEVICES[1].uuid}::1", ("jobs", "batch-b", "worker")),
        ("MIG-0a1b2c3d-0000-0000-0000-000000000000", ("jobs", "mig-user", "w")),
    ]  # GPU 2's example.com/nic is not an nvidia.com resource
    owners = owners_by_gpu(allocs, DEVICES)
    assert owners == {  # MIG devices name no whole GPU
        0: [("serving", "llm-7d9f-x2k4", "triton")],
        1: [("jobs", "batch-a", "worker"), ("jobs", "batch-b", "worker")],
    }
    assert parse_list_response(b"") == []


@pytest.mark.parametrize(
    "bad", [b"\x0a\x05ab", b"\x0a", b"\x0b\x00", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]
)
def test_decoder_refuses_truncated_or_malformed_bytes(bad: bytes) -> None:
    with pytest.raises(ValueError):
        parse_list_response(bad)


class FakeKubelet:
    """A gRPC server answering v1.PodResourcesLister/List on a unix socket."""

    def __init__(self, socket: Path, answer: bytes) -> None:
        self.answer = answer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: self.answer)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler}),)
        )
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


def dcgm_owners(fams) -> dict[str, tuple[str, str, str] | None]:
    out = {}
    for s in fams[c.DCGM_GPU_UTIL.name].samples:
        labels = s.labels
        owner = (labels.get("namespace"), labels.get("pod"), labels.get("container"))
        out[labels["gpu"]] = None if owner == (None, None, None) else owner
    return out


def test_a_gpu_allocated_to_one_container_carries_its_labels(tmp_path: Path) -> None:
    sock = tmp_path / "kubelet.sock"
    kubelet = FakeKubelet(sock, allocation())
    source = GpuSource(
        [lambda: SimulatedBackend(gpus=3)],
        label="simulated",
        hostname="node-a",
        pod_resources_socket=str(sock),
        process_interval_s=0.1,
    )
    try:
        with serve_in_thread(source, load_fields()) as exp:
            deadline = time.monotonic() + 15
            while dcgm_owners(fams := exp.scrape())["0"] is None:
                assert time.monotonic() < deadline, "GPU allocations never reached the labels"
                time.sleep(0.05)
            assert dcgm_owners(fams) == {"0": ("serving", "llm-7d9f-x2k4", "triton"), "1": None, "2": None}
            for field in load_fields():  # every dcgm series of GPU 0, with dcgm-exporter's label set
                (s,) = [s for s in fams[field.metric.name].samples if s.labels["gpu"] == "0"]
                assert set(s.labels) - {c.L_ERR_CODE, c.L_ERR_MSG} == set(c.GPU_POD_LABELS)
            # inferwatch's GPU series keep their contract labels
            for s in fams[c.GPU_FB_TOTAL_BYTES.name].samples:
                assert set(s.labels) == set(c.GPU_FB_TOTAL_BYTES.labels)

            # the pod goes away: its labels go with it
            kubelet.answer = Response().SerializeToString()
            while dcgm_owners(fams := exp.scrape())["0"] is not None:
                assert time.monotonic() < deadline, "labels of a gone pod stayed"
                time.sleep(0.05)

            # the kubelet stops answering: counted, and the exporter keeps serving
            kubelet.stop()
            key = c.GPU_BACKEND_ERRORS.name[: -len("_total")]

            def kubelet_errors() -> list[float]:
                return [s.value for s in exp.scrape()[key].samples if s.labels["call"] == "podresources.List"]

            while not kubelet_errors():
                assert time.monotonic() < deadline, "a failing kubelet was not counted"
                time.sleep(0.05)
            fams = exp.scrape()
            assert len(fams[c.DCGM_GPU_UTIL.name].samples) == 3
    finally:
        kubelet.stop()


def test_no_socket_means_no_pod_labels_and_no_grpc(tmp_path: Path) -> None:
    source = GpuSource(
        [lambda: SimulatedBackend(gpus=1)],
        label="simulated",
        hostname="node-a",
        pod_resources_socket=str(tmp_path / "absent.sock"),
    )
    with serve_in_thread(source, load_fields()) as exp:
        fams = exp.scrape()
    assert dcgm_owners(fams) == {"0": None}
    assert source._pods is None


# Defect 10: attribution by every device-id type, not only UUIDs. Three GPUs whose NVML index,
# minor number and UUID all differ, as on many 8-GPU servers (index 0 is /dev/nvidia4).
GPUS = (
    DeviceInfo(0, "GPU-aaaaaaaa-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 4),
    DeviceInfo(1, "GPU-bbbbbbbb-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 5),
    DeviceInfo(2, "GPU-cccccccc-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 0),
)


@pytest.mark.parametrize(
    ("device_id", "dra", "gpu"),
    [
        ("GPU-bbbbbbbb-0000-4000-8000-000000000000", False, 1),  # NVIDIA device plugin, UUID strategy
        ("GPU-bbbbbbbb-0000-4000-8000-000000000000::3", False, 1),  # time-slicing replica
        ("1", False, 1),  # NVIDIA device plugin, --device-id-strategy=index: the NVML index
        ("1::0", False, 1),  # index strategy with time-slicing
        ("nvidia0", False, 2),  # GKE: /dev/nvidia0 is the minor number, here GPU index 2
        ("nvidia4/vgpu2", False, 0),  # GKE time-sharing
        ("gpu-5", True, 1),  # NVIDIA's DRA driver: gpu-<minor>
        ("nvidia0/gi1", False, None),  # GKE MIG partition: no whole GPU
        ("MIG-0a1b2c3d-0000-0000-0000-000000000000", False, None),
        ("gpu-5-mig-9-0-1", True, None),  # DRA MIG device
        ("GPU-dddddddd-0000-4000-8000-000000000000", False, None),  # not on this node
        ("nvidia9", False, None),
    ],
)
def test_every_device_id_type_names_its_gpu(device_id: str, dra: bool, gpu: int | None) -> None:
    found = resolve(Allocation(device_id, ("ns", "pod", "c"), dra=dra), GPUS)
    assert (found.index if found else None) == gpu


def gke_index_and_dra_allocation() -> bytes:
    r = Response()
    gke = r.pod_resources.add(name="gke-pod", namespace="a")
    gke.containers.add(name="c").devices.add(resource_name="nvidia.com/gpu", device_ids=["nvidia0"])
    idx = r.pod_resources.add(name="index-pod", namespace="b")
    idx.containers.add(name="c").devices.add(resource_name="nvidia.com/gpu", device_ids=["1"])
    dra = r.pod_resources.add(name="dra-pod", namespace="c")
    claim = dra.containers.add(name="c").dynamic_resources.add(claim_name="gpu", claim_namespace="c")
    claim.claim_resources.add(driver_name="gpu.nvidia.com", pool_name="node-a", device_name="gpu-4")
    claim.claim_resources[0].cdi_devices.add(name="k8s.gpu.nvidia.com/device=gpu-4")
    other = dra.containers.add(name="nic").dynamic_resources.add(claim_name="nic", claim_namespace="c")
    other.claim_resources.add(driver_name="example.com/nic", pool_name="node-a", device_name="gpu-5")
    return r.SerializeToString()


def test_gke_index_and_dra_allocations_reach_the_dcgm_labels() -> None:
    allocs = parse_list_response(gke_index_and_dra_allocation())
    assert [(a.device_id, a.dra) for a in allocs] == [("nvidia0", False), ("1", False), ("gpu-4", True)]
    assert owners_by_gpu(allocs, GPUS) == {
        2: [("a", "gke-pod", "c")],
        1: [("b", "index-pod", "c")],
        0: [("c", "dra-pod", "c")],
    }


def test_labels_follow_a_gke_allocation_over_the_real_socket(tmp_path: Path) -> None:
    sock = tmp_path / "kubelet.sock"
    r = Response()
    r.pod_resources.add(name="gke-pod", namespace="a").containers.add(name="c").devices.add(
        resource_name="nvidia.com/gpu", device_ids=["nvidia1/vgpu0"]
    )
    kubelet = FakeKubelet(sock, r.SerializeToString())
    source = GpuSource(
        [lambda: SimulatedBackend(gpus=2)],
        label="simulated",
        hostname="node-a",
        pod_resources_socket=str(sock),
        process_interval_s=0.1,
    )
    try:
        with serve_in_thread(source, load_fields()) as exp:
            deadline = time.monotonic() + 15
            while dcgm_owners(fams := exp.scrape())["1"] is None:
                assert time.monotonic() < deadline, "a GKE allocation never reached the labels"
                time.sleep(0.05)
            assert dcgm_owners(fams) == {"0": None, "1": ("a", "gke-pod", "c")}
    finally:
        kubelet.stop()
