"""The dashboard in a real browser: Debian's headless Chromium, driven by Playwright, against a real gateway.

The gateway holds a loop's story (``tests/loop_story.py``): trained versions rejected, promoted and
rolled back by the loop, a candidate on canary after failed gate runs, a scored group of tool-using
conversations. Screenshots of every page at laptop and phone widths go to a directory the test prints.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from itsdangerous import URLSafeTimedSerializer
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.loop_story import HOSTILE, Story, tell
from tests.scripted_judge import ScriptedJudge
from tests.test_loop_versions import admin
from tests.vllm_standin import VllmStandIn

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAPTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}
ADMIN = {"authorization": "Bearer admin"}


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    with VllmStandIn() as vllm, ScriptedJudge() as judge:
        told = tell(tmp_path_factory.mktemp("ui"), vllm, judge)
        yield told
        told.gateway.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("screenshots")
    print(f"\ndashboard screenshots: {folder}")
    return folder


class Watched:
    """A page whose console errors, uncaught exceptions, dialogs and failed requests are collected."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.problems: list[str] = []
        self.dialogs: list[str] = []
        page.on("console", lambda m: self.problems.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.problems.append(f"exception: {e}"))
        page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url}"))
        page.on("response", lambda r: self.problems.append(f"{r.status}: {r.url}") if r.status >= 400 else None)
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def besides(self, status: int) -> list[str]:
        """The problems other than the page answering ``status`` (and the console's line saying so)."""
        return [p for p in self.problems if not p.startswith(f"{status}: ") and f"status of {status} " not in p]


def logged_in(browser: Browser, story: Story, viewport: dict[str, int]) -> Watched:
    page = browser.new_context(viewport=viewport).new_page()  # type: ignore[arg-type]
    watched = Watched(page)
    page.goto(f"{story.gateway.url}/flywheel/ui")
    page.fill("input[name=key]", "admin")
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Is the agent getting better?")
    return watched


def group_id(story: Story) -> str:
    """The weather group's id, as the groups page links it."""
    listed = httpx.get(f"{story.gateway.url}/flywheel/ui/groups", headers=ADMIN, timeout=30).text
    found = re.search(r"/groups/(grp_[0-9a-f]+)", listed)
    assert found is not None, listed
    return found.group(1)


def serving(story: Story) -> int:
    version: int = admin(story.gateway, "GET", "/aliases/agent/versions")["serving"]
    return version


def test_the_login_refuses_a_wrong_key(browser: Browser, story: Story) -> None:
    page = browser.new_context(viewport=LAPTOP).new_page()  # type: ignore[arg-type]
    watched = Watched(page)
    page.goto(f"{story.gateway.url}/flywheel/ui/trajectories")
    assert "/flywheel/ui/login" in page.url  # no session: to the login, and back afterwards
    page.fill("input[name=key]", "not-the-key")
    page.click("button[type=submit]")
    expect(page.get_by_role("alert")).to_have_text("That is not the admin key.")
    assert not [c for c in page.context.cookies() if c["name"] == "flywheel_dashboard"]
    page.fill("input[name=key]", "admin")
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Trajectories")
    (cookie,) = [c for c in page.context.cookies() if c["name"] == "flywheel_dashboard"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/flywheel/ui"
    assert f"401: {story.gateway.url}/flywheel/ui/login" in watched.problems  # the refused login ...
    assert watched.besides(401) == []  # ... and nothing else


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
def test_every_page_loads_without_console_errors(browser: Browser, story: Story, screenshots: Path,
                                                 viewport: dict[str, int]) -> None:
    watched = logged_in(browser, story, viewport)
    pages = {"overview": "", "trajectories": "/trajectories", "trajectory": "/trajectories/weather-a",
             "groups": "/groups", "group": f"/groups/{group_id(story)}", "versions": "/versions/agent",
             "confirm": f"/versions/agent/promote?version={story.versions['promoted']}"}
    for name, path in pages.items():
        response = watched.page.goto(f"{story.gateway.url}/flywheel/ui{path}")
        assert response is not None and response.status == 200, (name, response and response.status)
        watched.page.wait_for_load_state("networkidle")
        shot = screenshots / f"{name}-{viewport['width']}x{viewport['height']}.png"
        watched.page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        assert watched.problems == [], (name, watched.problems)
        width = watched.page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"{name} is {width} px wide: wider than the screen"
    overview = watched.page
    overview.goto(f"{story.gateway.url}/flywheel/ui")
    expect(overview.locator("svg.chart")).to_have_count(2)
    candidate = overview.locator(".fact").filter(has_text="Candidate")
    expect(candidate).to_contain_text(f"version {story.versions['canary']}")
    expect(overview.locator(".ab")).to_contain_text("Live A/B")
    expect(overview.locator(".failure").first).to_contain_text("failed")


def test_the_conversation_shows_tool_calls_results_and_branches(browser: Browser, story: Story) -> None:
    watched = logged_in(browser, story, LAPTOP)
    page = watched.page
    page.goto(f"{story.gateway.url}/flywheel/ui/trajectories/weather-b")
    call = page.locator(".call").first
    expect(call.locator(".fn")).to_have_text("get_weather")
    expect(call.locator("pre.args")).to_contain_text('"city": "Paris"')
    result = page.locator(".role-tool").first
    expect(result).to_contain_text("result of get_weather")
    expect(result).to_contain_text("good, good, clear skies")
    expect(page.locator(".role-user .text").first).to_have_text(HOSTILE)  # shown as text, never run
    assert page.locator("main script, main b").count() == 0 and watched.dialogs == []
    expect(page.locator(".score blockquote").first).to_contain_text("names the target")  # the judge's reason
    page.goto(f"{story.gateway.url}/flywheel/ui/trajectories/weather-a")
    expect(page.locator(".branches a")).to_have_count(2)
    page.click(".branches a >> text=1")
    expect(page.locator(".branches a[aria-current]")).to_have_text("1")
    expect(page.locator(".step")).to_have_count(2)
    page.goto(f"{story.gateway.url}/flywheel/ui/groups/{group_id(story)}")
    members = page.locator(".member")
    expect(members).to_have_count(3)
    expect(members.first.locator("h2")).to_have_text("weather-b")  # best first: 'good' twice in its forecast
    expect(members.last.locator("h2")).to_have_text("weather-c")
    assert watched.problems == []


def rows(page: Page) -> list[str]:
    return [text.strip() for text in page.locator("#results tbody tr td:first-child").all_inner_texts()]


def test_filters_narrow_the_list(browser: Browser, story: Story) -> None:
    watched = logged_in(browser, story, LAPTOP)
    page = watched.page
    page.goto(f"{story.gateway.url}/flywheel/ui/trajectories")
    everything = rows(page)
    assert len(everything) == 50 and "weather-a 2 branches" not in everything  # a page: the newest 50
    expect(page.get_by_role("link", name="Next page")).to_be_visible()
    page.fill("input[name=q]", "weather-")  # htmx: the list follows the search box, the URL follows the list
    expect(page.locator("#results tbody tr")).to_have_count(3)
    assert sorted(rows(page)) == ["weather-a 2 branches", "weather-b", "weather-c"]
    assert "q=weather-" in page.url
    page.fill("input[name=min_reward]", "0.7")
    page.locator("input[name=min_reward]").dispatch_event("change")
    expect(page.locator("#results tbody tr")).to_have_count(1)
    assert rows(page) == ["weather-b"]
    page.goto(f"{story.gateway.url}/flywheel/ui/trajectories?version={story.versions['rejected']}")
    narrowed = page.locator("#results tbody tr td:nth-child(3)").all_inner_texts()
    assert 0 < len(narrowed) < len(everything)
    assert all(str(story.versions["rejected"]) in cell.split(", ") for cell in narrowed)
    page.goto(f"{story.gateway.url}/flywheel/ui/trajectories?since=soon")
    expect(page.locator("h1")).to_contain_text("Invalid value for 'since'")
    assert f"400: {story.gateway.url}/flywheel/ui/trajectories?since=soon" in watched.problems
    assert watched.besides(400) == []


def test_bad_input_and_unknown_ids_get_readable_pages(story: Story) -> None:
    cases = {"/trajectories/no-such-trajectory": (404, "No trajectory found"),
             "/groups/grp_nope": (404, "No group found"), "/versions/nope": (404, "no alias named"),
             "/trajectories?version=two": (400, "Invalid value for &#39;version&#39;"),
             "/trajectories?min_reward=lots": (400, "Invalid value for &#39;min_reward&#39;"),
             "/trajectories?after=traj_unknown": (400, "Invalid value for &#39;after&#39;"),
             "/versions/agent/promote?version=-1": (400, "Invalid value for &#39;version&#39;"),
             "/?window=forever": (400, "Invalid value for &#39;window&#39;"),
             "/no/such/page": (404, "no dashboard page")}
    for path, (status, message) in cases.items():
        response = httpx.get(f"{story.gateway.url}/flywheel/ui{path}", headers=ADMIN, timeout=30)
        assert response.status_code == status and message in response.text, (path, response.status_code)
        assert response.headers["content-type"].startswith("text/html")


def session_cookie(story: Story) -> str:
    response = httpx.post(f"{story.gateway.url}/flywheel/ui/login", data={"key": "admin"}, timeout=30)
    assert response.status_code == 303
    assert "httponly" in response.headers["set-cookie"].lower()
    return response.cookies["flywheel_dashboard"]


def csrf_of(page_html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page_html)
    assert found is not None
    return found.group(1)


def test_no_session_or_a_forged_one_is_refused(story: Story) -> None:
    url = f"{story.gateway.url}/flywheel/ui"
    before = serving(story)
    valid = session_cookie(story)
    forged = URLSafeTimedSerializer(b"a guess", salt="flywheel-dashboard").dumps({"csrf": "x"})
    tampered = valid[:-2] + ("AA" if not valid.endswith("AA") else "BB")
    for cookie in (None, forged, tampered, "garbage"):
        cookies = {"flywheel_dashboard": cookie} if cookie else {}
        page = httpx.get(url + "/versions/agent", cookies=cookies, timeout=30)
        assert page.status_code == 303 and page.headers["location"].startswith("/flywheel/ui/login"), cookie
        posted = httpx.post(url + "/versions/agent/promote", cookies=cookies, timeout=30,
                            data={"version": str(story.versions["promoted"]), "csrf": "x"})
        assert posted.status_code == 401, (cookie, posted.status_code)
    token = csrf_of(httpx.get(url + "/versions/agent", cookies={"flywheel_dashboard": valid}, timeout=30).text)
    wrong_token = httpx.post(url + "/versions/agent/promote", cookies={"flywheel_dashboard": valid}, timeout=30,
                             data={"version": "0", "csrf": token[::-1]})
    assert wrong_token.status_code == 403 and "did not come from the dashboard" in wrong_token.text
    assert httpx.get(url, headers={"authorization": "Bearer nope"}, timeout=30).status_code == 401
    assert httpx.get(url, headers=ADMIN, timeout=30).status_code == 200  # scripts: the key itself
    assert serving(story) == before  # nothing above switched anything


def test_promote_and_rollback_change_the_serving_version(browser: Browser, story: Story) -> None:
    watched = logged_in(browser, story, LAPTOP)
    page = watched.page
    promoted, canary = story.versions["promoted"], story.versions["canary"]
    assert serving(story) == 0
    page.goto(f"{story.gateway.url}/flywheel/ui/versions/agent")
    page.locator(f"#v{promoted}").get_by_role("link", name="Promote…").click()
    expect(page.locator("h1")).to_have_text(f"Serve version {promoted} for agent?")
    expect(page.locator("p.bad")).to_contain_text(f"canary of version {canary} is stopped")
    assert serving(story) == 0  # nothing happens before the confirmation
    page.get_by_role("button", name="Promote").click()
    expect(page.locator("#serving")).to_have_text(f"version {promoted}")
    assert serving(story) == promoted
    versions: dict[int, Any] = {row["version"]: row for row in
                                admin(story.gateway, "GET", "/aliases/agent/versions")["data"]}
    assert versions[promoted]["reason"] == "promoted by hand (dashboard)"
    assert versions[canary]["status"] == "rejected"  # the canary was stopped, as the admin API does
    page.get_by_role("link", name="Roll back…").click()
    expect(page.locator("h1")).to_have_text("Roll agent back to the base model?")
    page.get_by_role("button", name="Roll back").click()
    expect(page.locator("#serving")).to_have_text("the base model (version 0)")
    assert serving(story) == 0
    rolled = {row["version"]: row for row in admin(story.gateway, "GET", "/aliases/agent/versions")["data"]}
    assert rolled[promoted]["status"] == "rolled_back" and "dashboard" in rolled[promoted]["reason"]
    assert watched.problems == []
