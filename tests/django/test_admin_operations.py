"""The admin page's history (timeline, transitions), live refresh, and Resign/Fence buttons.

Against a real nats-server with live candidates; the browser test drives
headless Chromium and saves screenshots (printed paths) of the status page
and the confirmation page.
"""

from __future__ import annotations

import os
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.test import Client

from django_nats_leader.timeline import BAR_HEIGHT
from tests.django.conftest import Candidates
from tests.django.test_admin import browser  # noqa: F401 - the headless Chromium fixture
from tests.support import REPO

URL = "/admin/django_nats_leader/electionstatus/"
DOCS_SCREENSHOT = os.environ.get("CNL_DOCS_SCREENSHOT") == "1"

pytestmark = [pytest.mark.django_db, pytest.mark.integration]


@pytest.fixture
def history(candidates: Candidates, nats_leader: Any) -> Candidates:
    """An events stream, then cand-a leads, resigns, and cand-b leads."""
    call_command("election_bucket", "--create", "--events-max-age", "3600", stdout=StringIO())
    candidates.start("cand-a", priority=5)
    assert candidates.handle("cand-a").wait_for_leadership(5)
    candidates.start("cand-b", priority=1)
    call_command("election_resign", "default", stdout=StringIO())
    assert candidates.handle("cand-b").wait_for_leadership(5)
    return candidates


def check_timeline_pixels(chart: Any, path: Path) -> None:
    """What the browser drew for the timeline: its size, the bars' colours on screen.

    The element's screenshot is read back pixel by pixel: it has the size the
    page gives the chart, the background strip before the first term, and the
    current leader's bar (the latest, widest term) in its own colour.
    """
    from PIL import Image
    from selenium.webdriver.common.by import By

    assert chart.screenshot(str(path))
    with Image.open(path) as shot:
        image = shot.convert("RGB")
    size = chart.size
    assert image.size == (round(size["width"]), round(size["height"]))
    assert image.size[0] >= 600, image.size  # readable, not squeezed
    scale = image.size[0] / float(chart.get_attribute("width"))
    assert image.getpixel((1, round(4 * scale))) == (0xEE, 0xEE, 0xEE)  # before the first term
    bars = chart.find_elements(By.CSS_SELECTOR, "g.term rect")
    current = bars[-1]
    left, width = float(current.get_attribute("x")), float(current.get_attribute("width"))
    assert width * scale >= 50, f"the current term is {width * scale:.0f} px wide"
    # Top middle of the bar: inside its fill, above the label text.
    x, y = round((left + width / 2) * scale), round(5 * scale)
    fill = current.get_attribute("fill").lstrip("#")
    assert image.getpixel((x, y)) == tuple(int(fill[i : i + 2], 16) for i in (0, 2, 4))
    assert y < BAR_HEIGHT * scale


def operator(client: Client | None = None, *, allowed: bool) -> User:
    user = User.objects.create_user("ops", password="s3cret-pw", is_staff=True)
    if allowed:
        user.user_permissions.add(Permission.objects.get(codename="operate_election"))
    if client is not None:
        client.force_login(user)
    return user


def test_history_timeline_and_live_marker(client: Client, history: Candidates) -> None:
    operator(client, allowed=False)
    html = client.get(URL + "?refresh=5").content.decode()
    assert "Live: refreshing every 5 s &middot; as of " in html
    assert "As of " in client.get(URL).content.decode()

    response = client.get(URL)
    assert list(response.context["histories"]) == ["default"]
    transitions = response.context["histories"]["default"]["transitions"]
    # Newest first, with the reasons.
    assert [(e.id, e.event.value, e.reason) for e in transitions] == [
        ("cand-b", "promoted", None),
        ("cand-a", "resigned", "resigned"),
        ("cand-a", "promoted", None),
    ]
    svg = str(response.context["histories"]["default"]["svg"])
    assert svg.count('<g class="term"') == 2
    assert 'data-leader="cand-a"' in svg and 'data-leader="cand-b"' in svg
    assert "cand-b, epoch" in svg and "still leading" in svg and "resigned (resigned)" in svg
    # No buttons without the permission, and the action pages refuse.
    assert "Resign</a>" not in response.content.decode()
    assert client.get(URL + "fence/default/").status_code == 403
    assert client.post(URL + "fence/default/").status_code == 403


def test_operator_resigns_through_a_confirmation_page(client: Client, history: Candidates) -> None:
    operator(client, allowed=True)
    html = client.get(URL).content.decode()
    assert f'href="{URL}resign/default/"' in html and f'href="{URL}fence/default/"' in html

    confirm = client.get(URL + "resign/default/").content.decode()
    assert "The leader of <strong>default</strong> is <strong>cand-b</strong>" in confirm
    assert "Yes, resign the leader of default" in confirm
    assert history.handle("cand-b").is_leader  # a GET changes nothing

    response = client.post(URL + "resign/default/", follow=True)
    assert response.redirect_chain == [(URL, 302)]
    text = response.content.decode()
    # (the admin capitalizes messages)
    assert "Cand-b stepped down from default; new leader cand-a" in text
    assert history.handle("cand-a").wait_for_leadership(5)


def test_page_without_a_stream_says_how_to_keep_history(
    client: Client, candidates: Candidates, nats_leader: Any
) -> None:
    candidates.start("cand-a")
    operator(client, allowed=False)
    html = client.get(URL).content.decode()
    assert 'id="election-no-history"' in html
    assert "manage.py election_bucket --create --events-max-age SECONDS" in html


@pytest.mark.django_db(transaction=True)
def test_fence_from_the_admin_in_chromium(
    browser: Any,  # noqa: F811
    live_server: Any,
    history: Candidates,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    operator(allowed=True)
    wait = WebDriverWait(browser, 30)
    browser.get(f"{live_server.url}/admin/login/?next={URL}?refresh=30")
    browser.find_element(By.NAME, "username").send_keys("ops")
    browser.find_element(By.NAME, "password").send_keys("s3cret-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "election-live")))

    live = browser.find_element(By.ID, "election-live")
    assert live.text.startswith("Live: refreshing every 30 s · as of ")
    chart = browser.find_element(By.CSS_SELECTOR, '.election-history[data-role="default"] svg')
    bars = chart.find_elements(By.CSS_SELECTOR, "g.term rect")
    assert len(bars) == 2 and all(bar.size["width"] > 0 for bar in bars)
    rows = browser.find_elements(
        By.CSS_SELECTOR, 'table.election-transitions[data-role="default"] tbody tr'
    )
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == [
        "promoted",
        "resigned",
        "promoted",
    ]
    status_shot = tmp_path / "status-with-history.png"
    assert browser.save_screenshot(str(status_shot))
    check_timeline_pixels(chart, tmp_path / "timeline.png")
    if DOCS_SCREENSHOT:
        # CNL_DOCS_SCREENSHOT=1 refreshes the picture docs/django.md shows.
        (REPO / "docs" / "images" / "admin-election-status.png").write_bytes(
            status_shot.read_bytes()
        )

    browser.find_element(By.CSS_SELECTOR, 'tr[data-role="default"] a.fence').click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "election-confirm")))
    assert "The leader of default is cand-b" in browser.find_element(By.ID, "election-target").text
    confirm_shot = tmp_path / "fence-confirmation.png"
    assert browser.save_screenshot(str(confirm_shot))

    browser.find_element(By.ID, "election-confirm").click()
    wait.until(expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "ul.messagelist")))
    message = browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text
    # cand-b is live: it hands over when asked, nothing is fenced.
    assert message.startswith("The leader cand-b (epoch "), message
    assert "handed default over cleanly on request; nothing fenced; new leader cand-a" in message
    after_shot = tmp_path / "after-fence.png"
    assert browser.save_screenshot(str(after_shot))
    assert history.handle("cand-a").wait_for_leadership(5)
    for shot in (status_shot, confirm_shot, after_shot):
        assert shot.stat().st_size > 5_000
        print(f"screenshot: {shot}")


def test_the_fence_and_resign_view_runs_outside_request_transactions(monkeypatch: Any) -> None:
    # Under ATOMIC_REQUESTS the fence was raised inside the request's
    # transaction: invisible to other connections until the response, and
    # its row lock held through the wait for the successor, whose first
    # fenced write then blocked. Django's own handler decides it:
    from django.core.handlers.base import BaseHandler
    from django.db import connections
    from django.urls import resolve

    view = resolve(f"{URL}fence/default/").func
    for alias in connections:
        monkeypatch.setitem(connections.settings[alias], "ATOMIC_REQUESTS", True)
    assert BaseHandler().make_view_atomic(view) is view
    # The read-only status page keeps the project's choice.
    status = resolve(URL).func
    assert BaseHandler().make_view_atomic(status) is not status
