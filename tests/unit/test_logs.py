"""The package's log lines on stderr: a notice, a warning, one line each however often
the CLI sets it up."""

import logging

from diloco_ray import logs


def test_notices_and_warnings_are_one_line_each(capsys):
    logs.to_stderr()
    logs.to_stderr()  # a second CLI call in one process adds no second handler
    logs.log.info("joining the running local Ray cluster at %s", "10.0.0.1:6379")
    logs.log.warning("starting with %d of num_replicas=%d replicas", 1, 2)
    logs.log.debug("not shown")
    assert capsys.readouterr().err.splitlines() == [
        "diloco-ray: joining the running local Ray cluster at 10.0.0.1:6379",
        "diloco-ray: warning: starting with 1 of num_replicas=2 replicas",
    ]


def test_lines_follow_sys_stderr_when_it_is_replaced(capsys):
    logs.to_stderr(logging.WARNING)
    capsys.readouterr()
    logs.log.warning("first")
    assert capsys.readouterr().err == "diloco-ray: warning: first\n"
    logs.log.warning("second")  # pytest gave this read a new stream
    assert capsys.readouterr().err == "diloco-ray: warning: second\n"
