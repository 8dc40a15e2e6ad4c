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
from exporters.podresources import parse_list_response
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
    msg(
        "ContainerResources",
        ("name", 1, F.TYPE_STRING, opt, ""),
        ("devices", 2, F.TYPE_MESSAGE, rep, ".v1.ContainerDevices"),
        ("cpu_ids", 3, F.TYPE_INT64, rep, ""),
        ("memory", 4, F.TYPE_MESSAGE, rep, ".v1.ContainerMemory"),
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
    owners = parse_list_response(allocation())
    assert owners[DEVICES[0].uuid] == [("serving", "llm-7d9f-x2k4", "triton")]
    assert owners[DEVICES[1].uuid] == [("jobs", "batch-a", "worker"), ("jobs", "batch-b", "worker")]
    assert DEVICES[2].uuid not in owners  # not an nvidia.com resource
    assert set(owners) == {DEVICES[0].uuid, DEVICES[1].uuid, "MIG-0a1b2c3d-0000-0000-0000-000000000000"}
    assert parse_list_response(b"") == {}


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
                assert set(s.labels) == set(c.GPU_POD_LABELS)
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
