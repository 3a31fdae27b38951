"""The admin status page: staff only, read-only, and rendering the leader in a real browser."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from celery_nats_leader.testing import free_port
from tests.django.conftest import IN_CI, Candidates

URL = "/admin/django_nats_leader/electionstatus/"
CHROMIUM = os.environ.get("CNL_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CNL_CHROMEDRIVER", "/usr/bin/chromedriver")

pytestmark = pytest.mark.django_db


@pytest.fixture
def led(candidates: Candidates, nats_leader: Any) -> Candidates:
    candidates.start("cand-a", priority=5)
    candidates.start("cand-b", priority=1)
    assert candidates.handle("cand-a").wait_for_leadership(5)
    return candidates


def login(client: Client, *, staff: bool, superuser: bool = False) -> User:
    user = User.objects.create_user("op", password="pw", is_staff=staff, is_superuser=superuser)
    client.force_login(user)
    return user


def test_anonymous_and_non_staff_are_sent_to_login(client: Client) -> None:
    response = client.get(URL)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]
    login(client, staff=False)
    response = client.get(URL)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


@pytest.mark.integration
def test_staff_sees_the_leader(client: Client, led: Candidates) -> None:
    login(client, staff=True)  # staff without any model permission
    token = led.handle("cand-a").token
    assert token is not None
    response = client.get(URL)
    assert response.status_code == 200
    rows = response.context["rows"]
    assert [(r.role, r.leader, r.epoch) for r in rows] == [("default", "cand-a", str(token.epoch))]
    assert [(c.id, c.state) for c in rows[0].candidates] == [
        ("cand-a", "leader"),
        ("cand-b", "follower"),
    ]
    html = response.content.decode()
    assert "Election status" in html
    assert 'id="election-roles"' in html
    # The index lists the page for staff.
    index = client.get("/admin/").content.decode()
    assert URL in index


@pytest.mark.integration
def test_page_is_read_only(client: Client, led: Candidates) -> None:
    login(client, staff=True, superuser=True)
    for path in ("add/", "default/change/", "default/delete/", "default/history/"):
        assert client.get(URL + path).status_code == 404, path
    fence = client.get("/admin/django_nats_leader/fenceepoch/")
    assert fence.status_code == 200
    assert 'href="/admin/django_nats_leader/fenceepoch/add/"' not in fence.content.decode()


def test_unreachable_nats_is_shown_not_raised(client: Client, settings: Any) -> None:
    settings.NATS_LEADER = {"SERVERS": [f"nats://127.0.0.1:{free_port()}"]}
    login(client, staff=True)
    response = client.get(URL)
    assert response.status_code == 200
    assert "Cannot read the elections" in response.content.decode()


def test_refresh_parameter(client: Client, settings: Any) -> None:
    settings.NATS_LEADER = {"SERVERS": [f"nats://127.0.0.1:{free_port()}"]}
    login(client, staff=True)
    html = client.get(URL + "?refresh=0").content.decode()
    assert '<meta http-equiv="refresh" content="1">' in html


# ------------------------------------------------------------------- browser


def _browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return f"{path} not found (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    missing = _browser_missing()
    if missing:
        if IN_CI:
            pytest.fail(f"headless Chromium is required when CI=true: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=Service(CHROMEDRIVER, log_output=str(tmp_path / "driver.log"))
    )
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_admin_page_in_chromium(
    browser: Any, live_server: Any, led: Candidates, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    User.objects.create_user("operator", password="s3cret-pw", is_staff=True)
    token = led.handle("cand-a").token
    assert token is not None
    wait = WebDriverWait(browser, 30)

    browser.get(f"{live_server.url}/admin/login/?next={URL}")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys("s3cret-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "election-roles")))

    shot = tmp_path / "election-status.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 5_000  # a real rendering, not an empty page
    row = browser.find_element(By.CSS_SELECTOR, '#election-roles tr[data-role="default"]')
    assert row.find_element(By.CSS_SELECTOR, "td.leader").text == "cand-a"
    assert row.find_element(By.CSS_SELECTOR, "td.epoch").text == str(token.epoch)
    assert "led" in (row.get_attribute("class") or "").split()
    candidates = browser.find_element(
        By.CSS_SELECTOR, 'table.election-candidates[data-role="default"]'
    )
    assert "2 live candidates" in candidates.text
    assert "cand-b" in candidates.text and "follower" in candidates.text
    assert (
        "every configured role has a leader" in browser.find_element(By.ID, "election-summary").text
    )
    print(f"screenshot: {shot}")
