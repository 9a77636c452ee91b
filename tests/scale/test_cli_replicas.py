import sys

from chatserve import cli


def test_replicas_without_ray_fails_at_start_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, installed or not
    code = cli.main(["serve", "--replicas", "2", "--model", "smollm2-135m-instruct"])
    assert code == 2
    err = capsys.readouterr().err
    assert "chatserve: error: --replicas needs Ray Serve" in err
    assert "pip install 'chatserve[scale]'" in err


def test_replicas_flag_defaults_to_one_process():
    args = cli.build_parser().parse_args(["serve"])
    assert args.replicas == 1
