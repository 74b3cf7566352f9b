"""The launcher and the initialization helpers, with plain Python processes (no JAX job)."""

import io
import sys
import time

import pytest

from jaxcomm import distributed, launch

PRINT_ENV = ("import os; print(os.environ['JAXCOMM_PROCESS_ID'], os.environ['JAXCOMM_NUM_PROCESSES'],"
             " os.environ['JAXCOMM_COORDINATOR'], os.environ.get('JAXCOMM_LOCAL_DEVICES'))")


def run(code, num_processes=2, **kwargs):
  output = io.StringIO()
  started = time.monotonic()
  status = launch.launch([sys.executable, "-c", code], num_processes, output=output, **kwargs)
  return status, output.getvalue(), time.monotonic() - started


def test_each_process_gets_its_variables_and_a_prefixed_output():
  status, output, _ = run(PRINT_ENV, num_processes=3, local_devices=4, port=23456)
  assert status == 0
  lines = sorted(output.splitlines())
  assert lines == [f"[process {i}] {i} 3 127.0.0.1:23456 4" for i in range(3)]


def test_a_free_port_is_picked_by_default():
  status, output, _ = run(PRINT_ENV, num_processes=1)
  port = int(output.split()[4].rsplit(":", 1)[1])
  assert status == 0 and 0 < port < 65536
  assert output.split()[5] == "None"  # no --local-devices: the variable is not set


def test_one_failure_stops_the_others_promptly_and_is_reported():
  code = ("import os, sys, time\n"
          "if os.environ['JAXCOMM_PROCESS_ID'] == '1': sys.exit(7)\n"
          "time.sleep(120); print('finished')")
  status, output, elapsed = run(code, num_processes=3)
  assert status == 7
  assert elapsed < 10
  assert "finished" not in output


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
  code = ("import os, signal, sys, time\n"
          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "if os.environ['JAXCOMM_PROCESS_ID'] == '0': print('ready', flush=True); time.sleep(120)\n"
          "time.sleep(1); sys.exit(5)")
  status, output, elapsed = run(code, grace=0.5)
  assert status == 5 and "ready" in output
  assert elapsed < 10


def test_a_process_killed_by_a_signal_reports_128_plus_the_signal():
  status, _, _ = run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", num_processes=1)
  assert status == 128 + 9


def test_help_documents_every_flag(capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  for flag in ("--num-processes", "--local-devices", "--port", "--coordinator-host", "--grace",
               "JAXCOMM_COORDINATOR"):
    assert flag in text


@pytest.mark.parametrize("argv, match", [
    (["-n", "0", "--", "true"], "--num-processes must be >= 1"),
    (["-n", "2", "--local-devices", "0", "--", "true"], "--local-devices must be >= 1"),
    (["-n", "2", "--port", "70000", "--", "true"], "--port must be <= 65535"),
    (["-n", "2", "--grace", "-1", "--", "true"], "--grace must be >= 0"),
    (["-n", "2", "--"], "give the command to run"),
])
def test_bad_flags_exit_with_a_clear_error(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(argv)
  assert exit_info.value.code == 2
  assert match in capsys.readouterr().err


def test_the_command_line_returns_the_failing_status():
  assert launch.main(["-n", "2", "--", sys.executable, "-c", "raise SystemExit(4)"]) == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"command": "python x.py"}, "command"),
    ({"num_processes": 0}, "num_processes"),
    ({"local_devices": 1.5}, "local_devices"),
    ({"port": 0}, "port"),
    ({"grace": -1}, "grace"),
])
def test_bad_launch_arguments_name_the_parameter(kwargs, match):
  arguments = {"command": ["true"], "num_processes": 2, **kwargs}
  with pytest.raises((TypeError, ValueError), match=match):
    launch.launch(arguments.pop("command"), arguments.pop("num_processes"), **arguments)


@pytest.mark.parametrize("args, kwargs, match", [
    (("localhost", 2, 0), {}, "coordinator"),
    (("localhost:0", 2, 0), {}, "coordinator"),
    ((1234, 2, 0), {}, "coordinator"),
    (("127.0.0.1:1234", 0, 0), {}, "num_processes"),
    (("127.0.0.1:1234", 2, 2), {}, "process_id must be < num_processes"),
    (("127.0.0.1:1234", 2, -1), {}, "process_id"),
    (("127.0.0.1:1234", 2, True), {}, "process_id"),
    (("127.0.0.1:1234", 2, 0, 0), {}, "local_devices"),
    (("127.0.0.1:1234", 2, 0), {"heartbeat_timeout": 0}, "heartbeat_timeout"),
])
def test_bad_initialize_arguments_name_the_parameter(args, kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    distributed.initialize(*args, **kwargs)


def test_initialize_from_env_without_the_variables_stays_single_process():
  assert distributed.initialize_from_env({}) is False


@pytest.mark.parametrize("environ, match", [
    ({"JAXCOMM_COORDINATOR": "127.0.0.1:1234"}, "JAXCOMM_NUM_PROCESSES, JAXCOMM_PROCESS_ID missing"),
    ({"JAXCOMM_COORDINATOR": "127.0.0.1:1234", "JAXCOMM_NUM_PROCESSES": "two",
      "JAXCOMM_PROCESS_ID": "0"}, "JAXCOMM_NUM_PROCESSES must be an integer, got 'two'"),
    ({"JAXCOMM_COORDINATOR": "127.0.0.1", "JAXCOMM_NUM_PROCESSES": "2",
      "JAXCOMM_PROCESS_ID": "0"}, "coordinator must be 'host:port'"),
    ({"JAXCOMM_COORDINATOR": "127.0.0.1:1234", "JAXCOMM_NUM_PROCESSES": "2",
      "JAXCOMM_PROCESS_ID": "0", "JAXCOMM_LOCAL_DEVICES": "x"}, "JAXCOMM_LOCAL_DEVICES"),
])
def test_initialize_from_env_names_the_bad_variable(environ, match):
  with pytest.raises(ValueError, match=match):
    distributed.initialize_from_env(environ)
