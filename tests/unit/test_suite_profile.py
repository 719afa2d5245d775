"""scripts/suite_profile.py: the tables it reads out of a run's JUnit XML, Ansible log and /proc/stat samples."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "suite_profile.py"
spec = importlib.util.spec_from_file_location("suite_profile", SCRIPT)
suite_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_profile)

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_site_e2e" name="test_site_converges" time="200.5"/>
<testcase classname="tests.integration.test_site_e2e" name="test_second_run_changes_nothing" time="20.0"/>
<testcase classname="tests.unit.test_planner" name="test_fits" time="0.5"/>
</testsuite></testsuites>"""

# Two ansible-playbook runs (pids 10 and 20) writing to one log at the same time, as two pytest workers do.
ANSIBLE_LOG = """\
2026-12-06 07:00:00,000 p=10 u=root n=ansible INFO| PLAY [Runtime] ***
2026-12-06 07:00:01,000 p=10 u=root n=ansible INFO| TASK [vllm_runtime : Install the pinned engine] ***
2026-12-06 07:00:02,000 p=20 u=root n=ansible INFO| TASK [Gathering Facts] *********
2026-12-06 07:00:03,500 p=20 u=root n=ansible INFO| ok: [kt-1]
2026-12-06 07:00:04,000 p=20 u=root n=ansible INFO| PLAY RECAP ***
  continued line without a stamp
2026-12-06 07:01:01,000 p=10 u=root n=ansible INFO| TASK [Gathering Facts] *********
2026-12-06 07:01:02,000 p=10 u=root n=ansible INFO| PLAY RECAP ***
"""

STAT = """\
1796538923 cpu  1000 0 200 800 0 0 0 0 0 0
1796538933 cpu  1500 0 300 1000 0 0 0 0 0 0
"""


def test_modules_and_tests_are_summed_and_ranked(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    modules, tests = suite_profile.junit_times(junit)
    assert modules == {"test_site_e2e": 220.5, "test_planner": 0.5}
    assert tests[0] == (200.5, "test_site_e2e::test_site_converges")


def test_each_step_ends_where_the_same_runs_next_step_begins(tmp_path):
    log = tmp_path / "ansible.log"
    log.write_text(ANSIBLE_LOG)
    seconds, count, runs = suite_profile.ansible_task_times(log)
    assert runs == 2
    assert seconds["TASK [vllm_runtime : Install the pinned engine]"] == pytest.approx(60.0)
    assert seconds["TASK [Gathering Facts]"] == pytest.approx(2.0 + 1.0)
    assert count["TASK [Gathering Facts]"] == 2
    assert seconds["PLAY [Runtime]"] == pytest.approx(1.0)


def test_cpu_shares_between_first_and_last_sample(tmp_path):
    stat = tmp_path / "stat.log"
    stat.write_text(STAT)
    shares = suite_profile.cpu_shares(stat)
    assert shares["user"] == pytest.approx(62.5) and shares["system"] == pytest.approx(12.5)
    assert shares["busy"] == pytest.approx(75.0)


def test_report_prints_markdown_tables(tmp_path, capsys):
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "ansible.log").write_text(ANSIBLE_LOG)
    (tmp_path / "stat.log").write_text(STAT)
    suite_profile.main(["report", "--junit", str(tmp_path / "junit.xml"), "--ansible-log",
                        str(tmp_path / "ansible.log"), "--stat", str(tmp_path / "stat.log"), "--top", "1"])
    out = capsys.readouterr().out
    assert "test time: 221 s in 3 tests" in out
    assert "| test_site_e2e | 220 |" in out and "test_planner" not in out
    assert "ansible: 2 runs, 4 steps, 64 s" in out
    assert "CPU: user 62%, system 12%, idle 25%, busy 75%" in out


def test_one_sample_is_not_enough(tmp_path):
    stat = tmp_path / "stat.log"
    stat.write_text(STAT.splitlines()[0] + "\n")
    with pytest.raises(SystemExit, match="fewer than two"):
        suite_profile.cpu_shares(stat)
