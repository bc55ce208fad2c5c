"""AppWorld's `execute_python` tool through seeupo-serve's MCP door (openenv's `MCPToolClient`):
listed with its schema, and a ground-truth solution run through it scores 1.0."""

from __future__ import annotations

import pytest

pytest.importorskip("openenv.core.mcp_client")
from openenv.core.mcp_client import MCPToolClient  # noqa: E402

from conftest import appworld_mini  # noqa: E402
from seeupo_gym.integrations.openenv_server import create_app  # noqa: E402
from serve_helpers import serving_in_process  # noqa: E402

pytestmark = pytest.mark.appworld

MINI, MINI_TASKS = appworld_mini()


@pytest.mark.slow
def test_execute_python_over_mcp_lists_its_schema_and_a_ground_truth_solution_scores_one():
    task_id = MINI_TASKS[0]
    solution = (MINI / "tasks" / task_id / "ground_truth" / "solution.py").read_text()
    app = create_app("seeupo/AppWorld-v0", {"split": "mini", "max_turns": 4, "action_format": "tools"}, max_sessions=2)
    with serving_in_process(app) as url:
        with MCPToolClient(base_url=url, message_timeout_s=300).sync() as env:
            env.reset(seed=0, task_id=task_id)
            tools = env.list_tools()
            assert [tool.name for tool in tools] == ["execute_python"]
            assert tools[0].input_schema["required"] == ["code"]
            printed = env.call_tool("execute_python", code="print(6 * 7)")
            assert printed["observation"].strip() == "42" and not printed["done"]
            result = env.call_tool("execute_python", code=solution)
    assert result["done"] and result["reward"] == 1.0
