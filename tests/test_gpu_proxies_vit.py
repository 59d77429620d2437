"""GPU proxies on the CPU (issue: CUDA-only crashes no CPU test saw), SGPT's and FedHPL's methods and variants."""
import pytest

from gpu_proxies import check_under_gpu_rules, runs_of


@pytest.mark.parametrize("experiment, method", runs_of("sgpt", "fedhpl"))
def test_runs_under_cuda_rules_and_keeps_its_server_side_on_the_run_device(experiment, method, tiny_method_root,
                                                                          tmp_path, monkeypatch):
    check_under_gpu_rules(experiment, method, tiny_method_root, tmp_path, monkeypatch)


def test_the_device_proxy_fails_where_the_engine_leaves_server_state_on_the_cpu(tiny_method_root, tmp_path,
                                                                                 monkeypatch):
    """The engine before its boundary placed nothing: SGPT's first server state (built with the model on the CPU)
    met the uploads made on CUDA in ``aggregate``. Without the placement the proxy meets that error on the CPU."""
    from fedcore.engine.placement import Boundary

    monkeypatch.setattr(Boundary, "place", lambda self, payload: payload)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        check_under_gpu_rules("sgpt_c100_s50", "sgpt", tiny_method_root, tmp_path, monkeypatch)
