"""Which containers get a GPU, and by which path (gpufence/webhook/core/gpu_paths.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpufence.webhook.cluster.policy import PolicyError, parse_policy
from gpufence.webhook.core.gpu_paths import PodGpuPaths, advised_resource, patterns, resource_pattern
from gpufence.webhook.core.settings import InjectionSettings

DEFAULTS = InjectionSettings()


def container(name: str = "main", limits: dict[str, str] | None = None, requests: dict[str, str] | None = None,
              claims: list[str] | None = None) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    if claims is not None:
        resources["claims"] = [{"name": c} for c in claims]
    return {"name": name, "image": "cuda", **({"resources": resources} if resources else {})}


def paths_of(*containers: dict[str, Any], claims: list[dict[str, str]] | None = None,
             settings: InjectionSettings = DEFAULTS) -> PodGpuPaths:
    spec: dict[str, Any] = {"containers": list(containers)}
    if claims is not None:
        spec["resourceClaims"] = claims
    return PodGpuPaths(spec, settings)


@pytest.mark.parametrize(("resource", "gpu"), [
    ("nvidia.com/gpu", True),
    ("nvidia.com/gpu.shared", True),  # time-slicing renameByDefault
    ("nvidia.com/mig-1g.10gb", True),  # MIG mixed strategy
    ("nvidia.com/mig-3g.20gb.shared", True),
    ("nvidia.com/gpu-fake", False),  # the prefix is "nvidia.com/gpu.", not "nvidia.com/gpu"
    ("nvidia.com/gpumem", False),
    ("amd.com/gpu", False),
    ("example.com/nvidia.com/gpu", False),
    ("cpu", False),
    ("memory", False),
])
def test_the_default_policy_knows_the_device_plugins_names_for_a_gpu(resource: str, gpu: bool) -> None:
    paths = paths_of(container(limits={resource: "1"}))
    assert paths.gpu_container_names() == (["main"] if gpu else [])
    assert paths.gets_device(container(limits={resource: "1"})) is gpu


@pytest.mark.parametrize("amounts", [
    {"limits": {"nvidia.com/mig-1g.10gb": "0"}},
    {"requests": {"nvidia.com/gpu.shared": "0"}},
    {"limits": {"nvidia.com/gpu.shared": "0"}, "requests": {"nvidia.com/gpu.shared": "1"}},  # the limit decides
])
def test_a_zero_amount_is_no_device(amounts: dict[str, dict[str, str]]) -> None:
    c = container(**amounts)
    paths = paths_of(c)
    assert paths.gpu_container_names() == [] and not paths.gets_device(c)


def test_an_exclusive_resource_gets_no_share_but_keeps_its_device() -> None:
    settings = InjectionSettings(exclusive_gpu_resource_names=("nvidia.com/mig-3g.*",))
    exclusive, shared = container("a", limits={"nvidia.com/mig-3g.40gb": "1"}), container("b", limits={
        "nvidia.com/mig-1g.10gb": "2"})
    paths = paths_of(exclusive, shared, settings=settings)
    assert paths.gpu_container_names() == ["b"]
    assert paths.gets_device(exclusive) and paths.gets_device(shared)
    assert paths.gpu_counts() == {"b": 2}


def test_an_exclusive_resource_counts_among_a_gpu_containers_devices() -> None:
    """A container on a shared GPU and an exclusive slice runs on two devices: the count allows both."""
    settings = InjectionSettings(exclusive_gpu_resource_names=("nvidia.com/mig-3g.40gb",))
    both = container(limits={"nvidia.com/gpu": "1", "nvidia.com/mig-3g.40gb": "1"})
    assert paths_of(both, settings=settings).gpu_counts() == {"main": 2}


def test_an_unlisted_claim_is_a_gpu_and_the_sidecar_gets_it() -> None:
    claims = [{"name": "nic", "resourceClaimTemplateName": "nic-t"}, {"name": "gpu", "resourceClaimName": "shared"}]
    settings = InjectionSettings(non_gpu_resource_claims=("nic-t",))
    main = container("main", limits={"nvidia.com/gpu": "1"}, claims=["nic", "gpu"])
    router = container("router", claims=["nic"])
    paths = paths_of(main, router, claims=claims, settings=settings)
    assert paths.gpu_container_names() == ["main"]
    # Held to the resources' count: an API server with DRA off drops the claims before the guard.
    assert paths.gpu_counts() == {"main": 1}
    assert paths.gets_device(router)  # never void on a container with a claim
    assert paths.sidecar_claims(["main"]) == ["gpu"]


def test_a_claim_listed_by_claim_name_or_template_name_is_no_gpu() -> None:
    settings = InjectionSettings(non_gpu_resource_claims=("nic", "fpga-template"))
    listed = ({"name": "c", "resourceClaimName": "nic"}, {"name": "c", "resourceClaimTemplateName": "fpga-template"})
    for claim in listed:
        assert paths_of(container(claims=["c"]), claims=[claim], settings=settings).gpu_container_names() == []
    unlisted = {"name": "c", "resourceClaimTemplateName": "gpu-template"}
    assert paths_of(container(claims=["c"]), claims=[unlisted], settings=settings).gpu_container_names() == ["main"]


def test_a_claim_only_container_has_no_count() -> None:
    """The claim's device count is in the ResourceClaim, not the pod: no count check."""
    paths = paths_of(container(claims=["gpu"]), claims=[{"name": "gpu", "resourceClaimTemplateName": "t"}])
    assert paths.gpu_container_names() == ["main"] and paths.gpu_counts() == {}


def test_a_claim_the_pod_does_not_declare_is_taken_for_a_gpu() -> None:
    """Garbage the API server refuses; the safe reading is a GPU."""
    assert paths_of(container(claims=["ghost"])).gpu_container_names() == ["main"]


def test_the_sidecars_claims_make_it_a_gpu_container_only_without_another() -> None:
    claims = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    sidecar = container("gpufence-enforcer", claims=["gpu"])
    assert paths_of(sidecar, container("main", claims=["gpu"]), claims=claims).gpu_container_names() == ["main"]
    assert paths_of(sidecar, claims=claims).gpu_container_names() == ["gpufence-enforcer"]


def test_garbage_is_no_device() -> None:
    for spec in (None, [], {"containers": "x"}, {"containers": [None, 3, {"resources": []}]},
                 {"containers": [{"name": "a", "resources": {"limits": ["nvidia.com/gpu"], "claims": "x"}}],
                  "resourceClaims": [None, {"name": 3}]}):
        paths = PodGpuPaths(spec, DEFAULTS)
        assert paths.gpu_container_names() == [] and paths.gpu_counts() == {}


@pytest.mark.parametrize("text", ["nvidia.com/gpu", "nvidia.com/gpu.*", "nvidia.com/mig-*", "example.com/*",
                                  " a/b "])
def test_resource_patterns_accepted(text: str) -> None:
    assert resource_pattern(text) == text.strip()


@pytest.mark.parametrize("text", ["", "*", "nvidia.com*", "gpu", "memory", "hugepages-*", "nvidia.com/*gpu",
                                  "nvidia.com/gpu**", "nvidia.com/", "/gpu", "nvidia.com/gpu,x"])
def test_resource_patterns_refused(text: str) -> None:
    """A pattern without a domain could match cpu, memory or hugepages: every container a GPU one."""
    with pytest.raises(ValueError, match="extended resource name"):
        resource_pattern(text)


def test_patterns_split_exact_names_and_prefixes() -> None:
    p = patterns(("nvidia.com/gpu", "nvidia.com/mig-*"))
    assert p.matches("nvidia.com/gpu") and p.matches("nvidia.com/mig-2g.20gb")
    assert not p.matches("nvidia.com/gpu.shared") and not p.matches("nvidia.com/mig")


def test_the_policy_keys_parse_into_the_settings() -> None:
    settings = parse_policy({"gpu-resource-name": "nvidia.com/gpu, example.com/gpu-*",
                             "exclusive-gpu-resource-name": "nvidia.com/mig-7g.80gb",
                             "non-gpu-resource-claims": "nic,fpga"})
    assert settings.gpu_resource_names == ("nvidia.com/gpu", "example.com/gpu-*")
    assert settings.exclusive_gpu_resource_names == ("nvidia.com/mig-7g.80gb",)
    assert settings.non_gpu_resource_claims == ("nic", "fpga")
    with pytest.raises(PolicyError, match='key "gpu-resource-name"'):
        parse_policy({"gpu-resource-name": "*"})


def test_a_denial_advises_an_exact_resource_name() -> None:
    assert advised_resource(DEFAULTS) == "nvidia.com/gpu"
    assert advised_resource(InjectionSettings(gpu_resource_names=("nvidia.com/mig-*", "amd.com/gpu"))) == "amd.com/gpu"
