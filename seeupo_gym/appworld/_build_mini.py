"""Build the "mini" AppWorld task set with the real AppWorld engine.

Run by the AppWorld interpreter only (it imports `appworld`, whose pins conflict with the
rest of the stack), as a plain script:

    .venv-appworld/bin/python -P seeupo_gym/appworld/_build_mini.py data/appworld-mini

The output folder has the layout of AppWorld's official `data/` folder: `tasks/<id>/`
(specs.json, dbs/, ground_truth/), `api_docs/standard/`, `datasets/mini.txt`. Every task's
databases are written by AppWorld's own app models; after writing, the builder opens each
task in a real `AppWorld`, replays the ground-truth solution (must pass every test) and a
no-op agent that completes the task at once (must fail at least one test), and only then
moves the folder into place and writes `.built`. Everything is fixed: same input, same data.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from textwrap import dedent

DATETIME = "2024-05-14T10:30:00"

SUPERVISOR = {
    "first_name": "Maya",
    "last_name": "Ortiz",
    "email": "maya.ortiz@gmail.com",
    "phone_number": "5550100001",
    "birthday": "1991-04-12",
    "sex": "female",
}
PASSWORDS = {"simple_note": "note-Ma7x!", "todoist": "todo-Qp3r!", "venmo": "venmo-Zk8w!", "phone": "phone-Lb2d!"}
FRIENDS = [
    {"first_name": "Liam", "last_name": "Chen", "email": "liam.chen@gmail.com", "phone_number": "5550100002",
     "birthday": "1990-02-03", "sex": "male"},
    {"first_name": "Sofia", "last_name": "Rossi", "email": "sofia.rossi@gmail.com", "phone_number": "5550100003",
     "birthday": "1992-09-21", "sex": "female"},
    {"first_name": "Noah", "last_name": "Patel", "email": "noah.patel@gmail.com", "phone_number": "5550100004",
     "birthday": "1989-12-30", "sex": "male"},
]
NOTES = [  # (title, content, tags, pinned)
    ("Lasagna", "Layer pasta, ragu and bechamel; bake 45 min.", ["recipe"], False),
    ("Pancakes", "Flour, milk, eggs, a pinch of salt.", ["recipe", "breakfast"], False),
    ("Green curry", "Paste, coconut milk, basil, chicken.", ["recipe", "spicy"], False),
    ("Trip plan draft", "Lisbon in June: flights, hostel, tram 28.", ["travel"], False),
    ("Budget draft", "Rent 1200, food 400, savings 300.", ["finance"], False),
    ("Book list", "Dune; The Left Hand of Darkness; Piranesi.", [], True),
]
TODO_PROJECTS = {  # project -> [(title, priority, is_completed)]
    "Home": [("Pay electricity bill", "high", False), ("Fix leaking tap", "medium", False),
             ("Buy plant pots", "low", True), ("Clean the garage", "low", False)],
    "Work": [("Prepare quarterly report", "high", False), ("Book meeting room", "medium", True)],
}
VENMO_BALANCE = 182.5
ALARMS = [  # (time, label, enabled)
    ("06:30", "Gym", True), ("07:15", "Wake up", True), ("18:00", "Gym", True), ("21:45", "Read", False),
]


@dataclass(frozen=True)
class MiniTask:
    task_id: str
    instruction: str
    difficulty: int
    apps: tuple[str, ...]
    answer: object
    solution: str
    # test requirement -> label ("no_op_fail": a do-nothing agent fails it; "no_op_pass": it passes)
    tests: dict[str, str]
    evaluation_body: str
    private_data: dict = field(default_factory=dict)


_LOGIN = {
    "simple_note": "apis.simple_note.login(username='{email}', password=passwords['simple_note'])",
    "todoist": "apis.todoist.login(username='{email}', password=passwords['todoist'])",
    "venmo": "apis.venmo.login(username='{email}', password=passwords['venmo'])",
    "phone": "apis.phone.login(username='{phone}', password=passwords['phone'])",
}


def _login(app: str) -> str:
    call = _LOGIN[app].format(email=SUPERVISOR["email"], phone=SUPERVISOR["phone_number"])
    return (
        "passwords = {p['account_name']: p['password'] for p in apis.supervisor.show_account_passwords()}\n"
        f"token = {call}['access_token']\n"
    )


# Shared evaluation fragments (they run inside AppWorld's evaluator).
_ANSWER_TEST = '''
with test("""assert the answer given to complete_task matches the ground truth answer."""):
    test.answer(predicted_answer, ground_truth_answer)
'''
_NO_ANSWER_TEST = '''
with test("""assert no answer was given to complete_task (the task asks for an action)."""):
    test.answer(predicted_answer, None)
'''
_PREAMBLE = "predicted_answer = json.loads(models.end.supervisor.Task.first().answer)\n"


def _no_other_changes(*model_names: str) -> str:
    allowed = sorted(model_names)
    return f'''
with test("""assert no model other than {", ".join(allowed)} changed."""):
    test.case(models.changed_model_names(ignore=[*user_models]), "<=", set({allowed!r}))
'''


def _tasks() -> list[MiniTask]:
    tasks = []
    tasks.append(MiniTask(
        task_id="mininote_1",
        instruction="How many of my Simple Note notes are tagged 'recipe'?",
        difficulty=1, apps=("simple_note",), answer=3,
        solution=_login("simple_note") + dedent("""\
            notes = apis.simple_note.search_notes(access_token=token, tags=['recipe'], page_limit=20)
            apis.supervisor.complete_task(answer=len(notes))
        """),
        tests={
            "assert the answer given to complete_task matches the ground truth answer.": "no_op_fail",
            "assert no model other than simple_note.Note changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _ANSWER_TEST + _no_other_changes("simple_note.Note"),
    ))
    tasks.append(MiniTask(
        task_id="mininote_2",
        instruction="Create a Simple Note note titled 'Packing list' with the content 'passport, charger, sunscreen'.",
        difficulty=1, apps=("simple_note",), answer=None,
        solution=_login("simple_note") + dedent("""\
            apis.simple_note.create_note(access_token=token, title='Packing list', content='passport, charger, sunscreen')
            apis.supervisor.complete_task()
        """),
        tests={
            "assert no answer was given to complete_task (the task asks for an action).": "no_op_pass",
            "assert exactly one note was added and none updated or removed.": "no_op_fail",
            "assert the new note has the requested title and content.": "no_op_fail",
            "assert no model other than simple_note.Note changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _NO_ANSWER_TEST + '''
added, updated, removed = models.changed_records("simple_note.Note")
with test("""assert exactly one note was added and none updated or removed."""):
    test.case((len(added), len(updated), len(removed)), "==", (1, 0, 0))
with test("""assert the new note has the requested title and content."""):
    test.case(len(added), "==", 1)
    test.case(added[0].title, "==", private_data.title, normalize_text=True)
    test.case(added[0].content, "==", private_data.content, normalize_text=True)
''' + _no_other_changes("simple_note.Note"),
        private_data={"title": "Packing list", "content": "passport, charger, sunscreen"},
    ))
    draft_titles = [t for t, _, _, _ in NOTES if "draft" in t.lower()]
    tasks.append(MiniTask(
        task_id="mininote_3",
        instruction="Pin every one of my Simple Note notes whose title contains the word 'draft'.",
        difficulty=2, apps=("simple_note",), answer=None,
        solution=_login("simple_note") + dedent("""\
            page = 0
            while True:
                notes = apis.simple_note.search_notes(access_token=token, query='draft', page_index=page, page_limit=20)
                if not notes:
                    break
                for note in notes:
                    if 'draft' in note['title'].lower():
                        apis.simple_note.update_note(access_token=token, note_id=note['note_id'], pinned=True)
                page += 1
            apis.supervisor.complete_task()
        """),
        tests={
            "assert no answer was given to complete_task (the task asks for an action).": "no_op_pass",
            "assert exactly the notes with 'draft' in the title were updated, none added or removed.": "no_op_fail",
            "assert every updated note is now pinned, with only its pinned status (and update time) changed.": "no_op_pass",
            "assert no model other than simple_note.Note changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _NO_ANSWER_TEST + '''
added, updated, removed = models.changed_records("simple_note.Note")
with test("""assert exactly the notes with 'draft' in the title were updated, none added or removed."""):
    test.case(sorted(note.title for note in updated), "==", sorted(private_data.draft_titles))
    test.case((len(added), len(removed)), "==", (0, 0))
with test("""assert every updated note is now pinned, with only its pinned status (and update time) changed."""):
    for note in updated:
        test.case(note.pinned, "==", True)
        test.case(models.changed_field_names("simple_note.Note", note.id, ignore=["updated_at"]), "==", {"pinned"})
''' + _no_other_changes("simple_note.Note"),
        private_data={"draft_titles": draft_titles},
    ))
    open_home = sum(1 for _, _, done in TODO_PROJECTS["Home"] if not done)
    tasks.append(MiniTask(
        task_id="minitodo_1",
        instruction="How many tasks in my Todoist project 'Home' are not completed yet?",
        difficulty=1, apps=("todoist",), answer=open_home,
        solution=_login("todoist") + dedent("""\
            projects = apis.todoist.show_projects(access_token=token, query='Home', page_limit=20)
            home = next(p for p in projects if p['name'] == 'Home')
            tasks = apis.todoist.show_tasks(access_token=token, project_id=home['project_id'], is_completed=False)
            count = len(tasks['no_section_tasks']) + sum(len(s['tasks']) for s in tasks['sections'])
            apis.supervisor.complete_task(answer=count)
        """),
        tests={
            "assert the answer given to complete_task matches the ground truth answer.": "no_op_fail",
            "assert no model other than todoist.Task changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _ANSWER_TEST + _no_other_changes("todoist.Task"),
    ))
    tasks.append(MiniTask(
        task_id="minitodo_2",
        instruction="Mark my Todoist task 'Pay electricity bill' as completed.",
        difficulty=1, apps=("todoist",), answer=None,
        solution=_login("todoist") + dedent("""\
            projects = apis.todoist.show_projects(access_token=token, page_limit=20)
            for project in projects:
                tasks = apis.todoist.show_tasks(access_token=token, project_id=project['project_id'])
                for task in tasks['no_section_tasks'] + [t for s in tasks['sections'] for t in s['tasks']]:
                    if task['title'] == 'Pay electricity bill':
                        apis.todoist.update_task(access_token=token, task_id=task['task_id'], is_completed=True)
            apis.supervisor.complete_task()
        """),
        tests={
            "assert no answer was given to complete_task (the task asks for an action).": "no_op_pass",
            "assert exactly one task was updated, none added or removed.": "no_op_fail",
            "assert the updated task is 'Pay electricity bill' and it is now completed, nothing else changed.": "no_op_pass",
            "assert no model other than todoist.Task changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _NO_ANSWER_TEST + '''
added, updated, removed = models.changed_records("todoist.Task")
with test("""assert exactly one task was updated, none added or removed."""):
    test.case((len(added), len(updated), len(removed)), "==", (0, 1, 0))
with test("""assert the updated task is 'Pay electricity bill' and it is now completed, nothing else changed."""):
    for task in updated:
        test.case(task.title, "==", private_data.title)
        test.case(task.is_completed, "==", True)
        test.case(models.changed_field_names("todoist.Task", task.id), "==", {"is_completed"})
''' + _no_other_changes("todoist.Task"),
        private_data={"title": "Pay electricity bill"},
    ))
    tasks.append(MiniTask(
        task_id="minivenmo_1",
        instruction="What is my current Venmo balance in dollars?",
        difficulty=1, apps=("venmo",), answer=VENMO_BALANCE,
        solution=_login("venmo") + dedent("""\
            balance = apis.venmo.show_venmo_balance(access_token=token)['venmo_balance']
            apis.supervisor.complete_task(answer=balance)
        """),
        tests={
            "assert the answer given to complete_task matches the ground truth answer.": "no_op_fail",
            "assert no model other than venmo.User changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _ANSWER_TEST + _no_other_changes("venmo.User"),
    ))
    tasks.append(MiniTask(
        task_id="minivenmo_2",
        instruction="Send $25 on Venmo to my friend Liam Chen with the description 'Pizza night'.",
        difficulty=2, apps=("venmo",), answer=None,
        solution=_login("venmo") + dedent("""\
            friends = apis.venmo.search_friends(access_token=token, query='Liam Chen')
            liam = next(f for f in friends if f['first_name'] == 'Liam' and f['last_name'] == 'Chen')
            apis.venmo.create_transaction(access_token=token, receiver_email=liam['email'], amount=25, description='Pizza night')
            apis.supervisor.complete_task()
        """),
        tests={
            "assert no answer was given to complete_task (the task asks for an action).": "no_op_pass",
            "assert exactly one transaction was added, none updated or removed.": "no_op_fail",
            "assert the new transaction sends $25 from the supervisor to Liam Chen with description 'Pizza night'.": "no_op_fail",
            "assert no model other than venmo.Notification, venmo.Transaction, venmo.User changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _NO_ANSWER_TEST + '''
added, updated, removed = models.changed_records("venmo.Transaction")
with test("""assert exactly one transaction was added, none updated or removed."""):
    test.case((len(added), len(updated), len(removed)), "==", (1, 0, 0))
with test("""assert the new transaction sends $25 from the supervisor to Liam Chen with description 'Pizza night'."""):
    test.case(len(added), "==", 1)
    sender = models.end.venmo.User.by_id(added[0].sender_id)
    receiver = models.end.venmo.User.by_id(added[0].receiver_id)
    test.case(sender.email, "==", main_user.email)
    test.case(receiver.email, "==", private_data.receiver_email)
    test.case(added[0].amount, "==", private_data.amount, tolerance=0.01)
    test.case(added[0].description, "==", private_data.description, normalize_text=True)
''' + _no_other_changes("venmo.Transaction", "venmo.User", "venmo.Notification"),
        private_data={"receiver_email": FRIENDS[0]["email"], "amount": 25.0, "description": "Pizza night"},
    ))
    gym_alarms = sum(1 for _, label, _ in ALARMS if label == "Gym")
    tasks.append(MiniTask(
        task_id="miniphone_1",
        instruction="Disable all of my phone alarms labeled 'Gym'.",
        difficulty=2, apps=("phone",), answer=None,
        solution=_login("phone") + dedent("""\
            alarms = apis.phone.show_alarms(access_token=token, page_limit=20)
            for alarm in alarms:
                if alarm['label'] == 'Gym':
                    apis.phone.update_alarm(access_token=token, alarm_id=alarm['alarm_id'], enabled=False)
            apis.supervisor.complete_task()
        """),
        tests={
            "assert no answer was given to complete_task (the task asks for an action).": "no_op_pass",
            "assert exactly the 'Gym' alarms were updated, none added or removed.": "no_op_fail",
            "assert every updated alarm is now disabled, nothing else changed.": "no_op_pass",
            "assert no model other than phone.Alarm changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _NO_ANSWER_TEST + '''
added, updated, removed = models.changed_records("phone.Alarm")
with test("""assert exactly the 'Gym' alarms were updated, none added or removed."""):
    test.case(sorted(alarm.label for alarm in updated), "==", ["Gym"] * private_data.num_gym_alarms)
    test.case((len(added), len(removed)), "==", (0, 0))
with test("""assert every updated alarm is now disabled, nothing else changed."""):
    for alarm in updated:
        test.case(alarm.enabled, "==", False)
        test.case(models.changed_field_names("phone.Alarm", alarm.id), "==", {"enabled"})
''' + _no_other_changes("phone.Alarm"),
        private_data={"num_gym_alarms": gym_alarms},
    ))
    tasks.append(MiniTask(
        task_id="miniphone_2",
        instruction="What is the phone number of my contact Sofia Rossi?",
        difficulty=1, apps=("phone",), answer=FRIENDS[1]["phone_number"],
        solution=_login("phone") + dedent("""\
            contacts = apis.phone.search_contacts(access_token=token, query='Sofia Rossi')
            sofia = next(c for c in contacts if c['first_name'] == 'Sofia' and c['last_name'] == 'Rossi')
            apis.supervisor.complete_task(answer=sofia['phone_number'])
        """),
        tests={
            "assert the answer given to complete_task matches the ground truth answer.": "no_op_fail",
            "assert no model other than phone.Contact changed.": "no_op_pass",
        },
        evaluation_body=_PREAMBLE + _ANSWER_TEST + _no_other_changes("phone.Contact"),
    ))
    return tasks


def _evaluation_code(task: MiniTask) -> str:
    body = "user_models = ['simple_note.User', 'todoist.User', 'venmo.User', 'phone.User']\n"
    body += task.evaluation_body
    indented = "\n".join(("    " + line) if line.strip() else "" for line in body.strip().splitlines())
    return (
        "import json\n\n\n"
        "def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):\n"
        f"{indented}\n"
    )


def _populate(models, instruction: str, api_docs: dict) -> None:
    """Write the shared world (one supervisor, three friends, four apps, every app's API
    docs for discovery through `apis.api_docs`) and the task record."""
    for app_name, api_name_to_doc in api_docs.items():
        for doc in api_name_to_doc.values():
            models.api_docs.ApiDoc.create_save(
                app_name_=app_name, api_name=doc["api_name"], path=doc["path"], method=doc["method"],
                description=doc["description"], parameters=doc["parameters"],
                response_schemas=doc["response_schemas"])
    admin = models.admin
    main_user = admin.MainUser.create_save(**SUPERVISOR)
    friend_users = [admin.MainUser.create_save(**f) for f in FRIENDS]
    for friend in friend_users:
        admin.Friendship.create_save(main_user_id=main_user.id, friend_id=friend.id)

    sup = models.supervisor
    supervisor = sup.Supervisor.create_save(**SUPERVISOR)
    for app, password in PASSWORDS.items():
        sup.AccountPassword.create_save(supervisor_id=supervisor.id, account_name=app, password=password)
    sup.Task.create_save(supervisor_id=supervisor.id, instruction=instruction)

    people = [SUPERVISOR, *FRIENDS]
    name = lambda p: {"first_name": p["first_name"], "last_name": p["last_name"]}  # noqa: E731

    note_user = models.simple_note.User.create_save(
        **name(SUPERVISOR), email=SUPERVISOR["email"], password=PASSWORDS["simple_note"], verified=True)
    for title, content, tags, pinned in NOTES:
        models.simple_note.Note.create_save(user_id=note_user.id, title=title, content=content, tags=tags, pinned=pinned)

    todo_user = models.todoist.User.create_save(
        **name(SUPERVISOR), email=SUPERVISOR["email"], password=PASSWORDS["todoist"], verified=True)
    for project_name, items in [("Inbox", []), *TODO_PROJECTS.items()]:
        project = models.todoist.Project.create_save(user_id=todo_user.id, name=project_name, is_inbox=project_name == "Inbox")
        models.todoist.ProjectCollaboratorLink.create_save(project_id=project.id, user_id=todo_user.id)
        for index, (title, priority, done) in enumerate(items):
            models.todoist.Task.create_save(project_id=project.id, user_id=todo_user.id, title=title,
                                            priority=priority, is_completed=done, order_index=index)

    venmo_users = []
    for person in people:
        balance = VENMO_BALANCE if person is SUPERVISOR else 100.0
        password = PASSWORDS["venmo"] if person is SUPERVISOR else "friend-pass-1"
        venmo_users.append(models.venmo.User.create_save(
            **name(person), email=person["email"], password=password, venmo_balance=balance, verified=True))
    for friend in venmo_users[1:]:
        models.venmo.Friendship.create_save(user_id=venmo_users[0].id, friend_id=friend.id)
        models.venmo.Friendship.create_save(user_id=friend.id, friend_id=venmo_users[0].id)

    phone_user = models.phone.User.create_save(
        **name(SUPERVISOR), phone_number=SUPERVISOR["phone_number"], password=PASSWORDS["phone"])
    for friend in FRIENDS:
        models.phone.Contact.create_save(user_id=phone_user.id, **name(friend), email=friend["email"],
                                         phone_number=friend["phone_number"], relationships=["friend"],
                                         birthday=friend["birthday"])
    for time, label, enabled in ALARMS:
        models.phone.Alarm.create_save(user_id=phone_user.id, time=time, label=label, enabled=enabled,
                                       repeat_days=["monday", "wednesday", "friday"])


def _write_json(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_task(task: MiniTask, data_dir: str, api_docs: dict) -> None:
    from appworld.apps import get_all_apps
    from appworld.apps.api_lib import set_local_date_and_time
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import CANARY_STRING, DB_VERSION
    from appworld.common.datetime import DateTime

    task_dir = os.path.join(data_dir, "tasks", task.task_id)
    apps = get_all_apps()
    freezer = set_local_date_and_time(DateTime.fromisoformat(DATETIME))
    try:
        models = ModelCollection.load(to_db_home_path=f":memory:mini-build-{task.task_id}", load_apps=apps,
                                      create_db=True)
        _populate(models, task.instruction, api_docs)
        with contextlib.redirect_stdout(io.StringIO()):  # AppWorld prints a line per file it writes
            models.save(db_home_path=os.path.join(task_dir, "dbs"), format="full", app_names=list(apps),
                        delete_if_exists=True)
        models.close()
    finally:
        freezer.stop()

    supervisor = {k: SUPERVISOR[k] for k in ("first_name", "last_name", "email", "phone_number")}
    _write_json({"instruction": task.instruction, "supervisor": supervisor, "datetime": DATETIME,
                 "db_version": DB_VERSION, "canary_string": CANARY_STRING}, os.path.join(task_dir, "specs.json"))
    gt = os.path.join(task_dir, "ground_truth")
    _write_json({}, os.path.join(gt, "public_data.json"))
    _write_json(task.private_data, os.path.join(gt, "private_data.json"))
    with open(os.path.join(gt, "answer.json"), "w") as f:
        f.write(json.dumps(task.answer))
    with open(os.path.join(gt, "evaluation.py"), "w") as f:
        f.write(_evaluation_code(task))
    # The solution is what a correct agent would run; minimal-mode loading ignores it.
    with open(os.path.join(gt, "solution.py"), "w") as f:
        f.write(task.solution)
    _write_json([{"requirement": r, "label": label} for r, label in task.tests.items()],
                os.path.join(gt, "test_data.json"))
    # The statistics are given here: AppWorld would derive them by running `black` on the code.
    _write_json({"difficulty": task.difficulty, "mode": "minimal", "num_apps": len(task.apps),
                 "num_apis": len(set(re.findall(r"apis\.(\w+\.\w+)", task.solution))),
                 "num_solution_code_lines": len(task.solution.strip().splitlines()),
                 "required_apps": list(task.apps)}, os.path.join(gt, "metadata.json"))


def _verify(task: MiniTask) -> None:
    """Replay the solution and a do-nothing agent in a real world; fail the build if the task is broken."""
    from appworld import AppWorld

    with AppWorld(task_id=task.task_id, experiment_name="mini-verify-discovery") as world:
        listing = world.execute("print(apis.api_docs.show_api_descriptions(app_name='supervisor'))")
    if "complete_task" not in listing:
        raise SystemExit(f"{task.task_id}: API discovery does not work: {listing[:500]}")
    outcomes = {}
    for name, code in (("solution", task.solution), ("no_op", "apis.supervisor.complete_task()")):
        with AppWorld(task_id=task.task_id, experiment_name=f"mini-verify-{name}", random_seed=100) as world:
            output = world.execute(code)
            if "Execution failed" in output:
                raise SystemExit(f"{task.task_id}: the {name} failed to run:\n{output}")
            tracker = world.evaluate(suppress_errors=True)
        outcomes[name] = tracker
    solution, no_op = outcomes["solution"], outcomes["no_op"]
    if not solution.success:
        raise SystemExit(f"{task.task_id}: the ground-truth solution fails: {solution.failures}")
    if no_op.success:
        raise SystemExit(f"{task.task_id}: a do-nothing agent passes every test")
    no_op_passed = {p["requirement"] for p in no_op.passes}
    expected = {r for r, label in task.tests.items() if label == "no_op_pass"}
    if no_op_passed != expected:
        raise SystemExit(f"{task.task_id}: test labels are wrong: a do-nothing agent passes {no_op_passed}")
    print(f"  {task.task_id}: solution {solution.pass_count}/{solution.num_tests}, "
          f"no-op {no_op.pass_count}/{no_op.num_tests}", flush=True)


def _write_api_docs(data_dir: str) -> dict:
    """`api_docs/standard/<app>.json`, generated from the apps' own code, returned as
    {app: {api: doc}}. (AppWorld's `ApiDocCollection.save` also writes the OpenAPI format,
    which needs an extra package.)"""
    from munch import unmunchify

    from appworld.apps import get_all_apps
    from appworld.collections.api_docs import ApiDocCollection
    from appworld.common.constants import CANARY_STRING

    docs = unmunchify(ApiDocCollection.build(tuple(get_all_apps(skip_admin=True))))
    for app_name, api_name_to_doc in docs.items():
        standard = {name: {**doc, "canary_string": CANARY_STRING} for name, doc in api_name_to_doc.items()}
        _write_json(standard, os.path.join(data_dir, "api_docs", "standard", app_name + ".json"))
    return docs


def build(out_dir: str) -> None:
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging_root = tempfile.mkdtemp(prefix=".appworld-mini-build-", dir=parent)
    try:
        # AppWorld reads `$APPWORLD_ROOT/data` and writes `$APPWORLD_ROOT/experiments`.
        os.environ["APPWORLD_ROOT"] = staging_root
        os.environ["IPYTHONDIR"] = os.path.join(staging_root, ".ipython")
        data_dir = os.path.join(staging_root, "data")
        api_docs = _write_api_docs(data_dir)
        tasks = _tasks()
        for task in tasks:
            _write_task(task, data_dir, api_docs)
        os.makedirs(os.path.join(data_dir, "datasets"), exist_ok=True)
        with open(os.path.join(data_dir, "datasets", "mini.txt"), "w") as f:
            f.write("".join(task.task_id + "\n" for task in tasks))
        print(f"verifying {len(tasks)} tasks with the real AppWorld engine", flush=True)
        for task in tasks:
            _verify(task)
        with open(os.path.join(data_dir, ".built"), "w") as f:
            f.write(f"{len(tasks)} tasks\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(data_dir, out_dir)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    print(f"built {len(tasks)} AppWorld mini tasks into {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -P _build_mini.py OUT_DIR")
    build(sys.argv[1])
