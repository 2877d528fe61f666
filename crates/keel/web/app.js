// Keel's web console: one page, routed by the URL's hash, every byte of
// data from the API with the token kept in this tab's sessionStorage.
// The VM list and VM pages live on one streamed watch of the VMs
// (GET /api/v1/vms?watch=true), not on a poll per row. Text from the
// API is only ever set as text (never as HTML).

import { Terminal } from "/ui/xterm.mjs";
import RFB from "/ui/novnc/core/rfb.js";

const TOKEN_KEY = "keel.token";
const ROLE_RANK = { viewer: 0, operator: 1, admin: 2 };
// What each action needs (api/roles.rs); buttons beyond the token's role
// are not shown, and the API refuses them anyway.
const NEEDS = {
  start: "operator", stop: "operator", restart: "operator", reboot: "operator",
  console: "operator", screen: "operator", snapshot: "operator", migrate: "operator",
  delete: "admin", create: "admin", restore: "admin", drain: "admin", uncordon: "admin",
};
const WAIT_LIMIT_MS = 300_000;

const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  who: null,
  vms: new Map(), // name -> { vm, ready, revision }
  synced: false,
  watch: null, // AbortController of the running watch
  progress: null, // { name, verb, goal, started, done, failed, text }
  console: null, // { ws, term, vm }
  screen: null, // { rfb, vm }: the graphical console (noVNC)
  detailsFor: null, // "name@revision" whose details were fetched last
};

const $ = (id) => document.getElementById(id);

// --- DOM helpers -------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const badge = (text, cls = text) => h("span", { class: `badge ${cls}` }, text);
const dash = (v) => (v === undefined || v === null || v === "" ? "-" : v);

function kv(pairs) {
  return h("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "-")]));
}

function panel(title, body, ...headExtra) {
  return h("div", { class: "panel" },
    h("div", { class: "section-head" }, h("h2", {}, title), ...headExtra),
    body);
}

function table(headers, rows, emptyText) {
  if (rows.length === 0) return h("div", { class: "empty" }, emptyText);
  return h("table", {},
    h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))),
    h("tbody", {}, rows));
}

function time(ms) {
  if (!ms) return "-";
  return new Date(ms).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function ago(ms) {
  if (!ms) return "-";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s}s ago`;
  if (s < 3600) return `${Math.round(s / 60)}m ago`;
  return `${Math.round(s / 3600)}h ago`;
}

const can = (action) => state.who && ROLE_RANK[state.who.role] >= ROLE_RANK[NEEDS[action]];

// --- the API -----------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, field) {
    super(field ? `${message} (field ${field})` : message);
    this.status = status;
    this.field = field;
  }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${state.token}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, {
    method, headers, cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!resp.ok) {
    if (resp.status === 401 && path !== "/api/v1/whoami") signOut("The token was refused: sign in again.");
    throw new ApiError(resp.status, data?.error ?? `${resp.status} ${resp.statusText}`, data?.field);
  }
  return data;
}

const enc = encodeURIComponent;

// --- the VM watch ------------------------------------------------------

async function watchVms() {
  const ctrl = new AbortController();
  state.watch = ctrl;
  let pause = 1000;
  while (!ctrl.signal.aborted) {
    try {
      const resp = await fetch("/api/v1/vms?watch=true", {
        headers: { Authorization: `Bearer ${state.token}` },
        cache: "no-store", signal: ctrl.signal,
      });
      if (resp.status === 401) { signOut("The token was refused: sign in again."); return; }
      if (!resp.ok) throw new Error(`watch: ${resp.status}`);
      const fresh = new Map();
      let synced = false;
      setLive(true);
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let nl;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, nl).trim();
          buf = buf.slice(nl + 1);
          if (!line) continue;
          const msg = JSON.parse(line);
          // Until `synced` the list is built aside, so a re-subscription
          // never shows a half list.
          const target = synced ? state.vms : fresh;
          switch (msg.type) {
            case "put": target.set(msg.vm.name, { vm: msg.vm, ready: msg.ready, revision: msg.revision }); break;
            case "deleted": target.delete(msg.name); break;
            case "synced": synced = true; state.vms = fresh; state.synced = true; break;
            case "error": throw new Error(msg.error);
          }
          if (synced) vmsChanged(msg.vm?.name ?? msg.name);
        }
      }
      pause = 1000;
    } catch (err) {
      if (ctrl.signal.aborted) return;
      console.warn("VM watch ended:", err);
    }
    if (ctrl.signal.aborted) return;
    setLive(false);
    // The stream ended (server restart, network): subscribe again.
    await new Promise((r) => setTimeout(r, pause));
    pause = Math.min(pause * 2, 10_000);
  }
}

function setLive(on) {
  const el = $("live");
  el.hidden = false;
  el.className = `live ${on ? "on" : "off"}`;
  el.textContent = on ? "live" : "reconnecting…";
}

let renderQueued = false;
function vmsChanged(name) {
  checkProgress();
  // A VM's page is not redrawn (and a click in flight lost) for a change
  // of another VM that neither it nor its progress box shows.
  const { page, name: shown } = route();
  if (page === "vm" && name !== undefined && name !== shown && name !== state.progress?.name) return;
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => { renderQueued = false; render(); });
}

// --- progress of an action, as `--wait` waits for it (cli/wait.rs) --------

function goalFor(verb, vm) {
  const inst = vm.status.instance;
  switch (verb) {
    case "start":
      return { what: "be Running and ready", reached: (v, ready) => v.status.phase === "Running" && v.status.observed_generation >= vm.generation && ready };
    case "stop":
      return { what: "be Stopped", reached: (v) => v.status.phase === "Stopped" && !v.status.instance && v.status.observed_generation >= vm.generation };
    case "restart":
      return { what: "run a new instance and be ready", reached: (v, ready) => v.status.phase === "Running" && v.status.observed_restart_generation >= vm.spec.restart_generation && v.status.instance?.id !== inst?.id && ready };
    case "reboot":
      return { what: "reboot its guest and be ready again", reached: (v, ready) => v.status.phase === "Running" && v.status.observed_reboot_generation >= vm.reboot_generation && v.status.instance?.id === inst?.id && (v.status.instance?.resets ?? 0) > (inst?.resets ?? 0) && !v.status.instance?.reboot && ready };
    case "delete":
      return { what: "be deleted", reached: () => false, gone: true };
    case "restore": {
      // The controller's rule (VirtualMachine::power_after_restore) and
      // the end of a restore (restored_to), as `keel snapshot restore --wait`.
      const power = vm.spec.run_policy === "AlwaysOn" ? "Running"
        : vm.spec.run_policy === "AlwaysOff" ? "Stopped"
          : (vm.power_intent?.power ?? vm.spec.power);
      return {
        what: `be restored and ${power}`,
        reached: (v) => !v.restore && !v.power_intent && (power === "Running"
          ? v.status.phase === "Running" && !!v.status.instance
          : v.status.phase === "Stopped" && !v.status.instance),
      };
    }
    default:
      return null;
  }
}

function progressLine(name, entry) {
  if (!entry) return `${name}: gone`;
  const { vm, ready } = entry;
  const s = vm.status;
  let line = `${name}: ${s.phase}`;
  if (s.instance) {
    line += ` (instance ${s.instance.id})`;
    if (s.phase === "Running") line += ready ? " ready" : (s.instance.readiness?.reason ? ` not ready: ${s.instance.readiness.reason}` : " not ready");
  }
  if (s.message) line += `: ${s.message}`;
  return line;
}

function checkProgress() {
  const p = state.progress;
  if (!p || p.done || p.failed) return;
  const entry = state.vms.get(p.name);
  p.text = progressLine(p.name, entry);
  if (p.goal.gone ? !entry : entry && p.goal.reached(entry.vm, entry.ready)) {
    p.done = true;
    p.text = p.goal.gone ? `${p.name}: deleted` : `${p.name}: ${p.verb} done, ${progressLine(p.name, entry).slice(p.name.length + 2)}`;
  } else if (!entry && !p.goal.gone) {
    p.failed = true;
    p.text = `${p.verb}: ${p.name} was deleted while waiting for it to ${p.goal.what}`;
  } else if (Date.now() - p.started > WAIT_LIMIT_MS) {
    p.failed = true;
    p.text = `${p.verb}: timed out waiting for ${p.name} to ${p.goal.what} (${p.text})`;
  }
}

async function act(name, verb, request) {
  try {
    const resp = await request();
    const goal = resp?.vm ? goalFor(verb, resp.vm) : null;
    state.progress = goal
      ? { name, verb, goal, started: Date.now(), text: `${name}: ${verb} requested` }
      : { name, verb, done: true, text: `${name}: ${verb} requested` };
    checkProgress();
  } catch (err) {
    state.progress = { name, verb, failed: true, text: `${verb} ${name}: ${err.message}` };
  }
  render();
}

const power = (name, verb) => act(name, verb, () => api("POST", `/api/v1/vms/${enc(name)}/${verb}`));

function progressBox() {
  const p = state.progress;
  if (!p) return null;
  const cls = p.done ? "done" : p.failed ? "failed" : "busy";
  return h("div", { id: "progress", class: cls, "data-state": cls },
    h("span", { class: "spinner" }), h("span", { id: "progress-text" }, p.text),
    (p.done || p.failed) && h("button", { class: "small", onclick: () => { state.progress = null; render(); } }, "Dismiss"));
}

// Timed waits only re-check the clock; the state they read comes from the watch.
setInterval(() => { if (state.progress && !state.progress.done && !state.progress.failed) { checkProgress(); render(); } }, 5000);

// --- views ---------------------------------------------------------------

function route() {
  const parts = (location.hash.replace(/^#\/?/, "") || "vms").split("/").map(decodeURIComponent);
  return { page: parts[0], name: parts[1] };
}

function render() {
  if (!state.who) return;
  const { page, name } = route();
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === page);
  const view = $("view");
  let content;
  switch (page) {
    case "vm": content = vmPage(name); break;
    case "nodes": content = nodesPage(); break;
    case "images": content = imagesPage(); break;
    case "events": content = eventsPage(); break;
    default: content = vmsPage(); break;
  }
  // A form being filled in is not thrown away by a live update.
  const active = document.activeElement;
  if (active && view.contains(active) && active.closest("form.create")) return;
  view.replaceChildren(content);
  if (page !== "vm" && state.console) closeConsole();
  if (page !== "vm" && state.screen) closeScreen();
}

function powerButtons(name, vm) {
  const b = (verb, label, cls = "small") => can(verb)
    ? h("button", { class: cls, "data-action": verb, onclick: () => power(name, verb) }, label)
    : null;
  const deleting = !!vm.deletion_requested_at;
  return [
    !deleting && b("start", "Start"),
    !deleting && b("stop", "Stop"),
    !deleting && b("restart", "Restart"),
    !deleting && b("reboot", "Reboot"),
    can("delete") && !deleting && h("button", {
      class: "small danger", "data-action": "delete",
      onclick: () => { if (confirm(`Delete VM ${name}? Its disks are removed.`)) act(name, "delete", () => api("DELETE", `/api/v1/vms/${enc(name)}`)); },
    }, "Delete"),
  ];
}

function vmsPage() {
  const rows = [...state.vms.values()]
    .sort((a, b) => a.vm.name.localeCompare(b.vm.name))
    .map(({ vm, ready }) => {
      const inst = vm.status.instance;
      return h("tr", { "data-vm": vm.name },
        h("td", {}, h("a", { href: `#/vm/${enc(vm.name)}` }, vm.name)),
        h("td", { class: "phase" }, badge(vm.status.phase)),
        h("td", { class: "ready" }, badge(ready ? "yes" : "no")),
        h("td", {}, vm.spec.power),
        h("td", {}, vm.spec.run_policy),
        h("td", {}, `${vm.spec.cpus} / ${vm.spec.memory_mib} MiB`),
        h("td", {}, dash(inst?.node)),
        h("td", {}, restartRequired(vm)),
        h("td", { class: "reason" }, dash(vm.status.message)),
        h("td", {}, h("span", { class: "row-actions" }, powerButtons(vm.name, vm))));
    });
  return h("div", { class: "stack" },
    h("div", { class: "page-head" }, h("h1", {}, "Virtual machines"),
      h("span", { class: "muted" }, state.synced ? `${state.vms.size} VMs` : "loading…"),
      h("div", { class: "actions" }, can("create") && h("button", { class: "primary", "data-action": "create", onclick: toggleCreate }, "Create VM"))),
    progressBox(),
    createForm(),
    h("div", { class: "panel", id: "vm-list" },
      table(["Name", "Phase", "Ready", "Power", "Policy", "CPUs / memory", "Node", "Restart", "Reason", ""], rows,
        state.synced ? "No VMs yet." : "Loading…")));
}

function restartRequired(vm) {
  const r = vm.status.restart_required;
  if (!r || (Array.isArray(r) && r.length === 0) || (r.fields && r.fields.length === 0)) return "-";
  const fields = Array.isArray(r) ? r : (r.fields ?? Object.keys(r));
  return badge(`needed: ${fields.join(", ")}`, "warn");
}

// --- create (the fields of `keel vm create`) -------------------------------

let createOpen = false;
function toggleCreate() { createOpen = !createOpen; render(); }

function createForm() {
  if (!createOpen || !can("create")) return null;
  const field = (label, input) => h("label", {}, label, input);
  const form = h("form", { class: "create panel", id: "create-form" },
    field("Name", h("input", { name: "name", required: true, pattern: "[a-z0-9]([-a-z0-9]*[a-z0-9])?" })),
    field("CPUs", h("input", { name: "cpus", type: "number", min: 1, value: 1 })),
    field("Memory (MiB)", h("input", { name: "memory_mib", type: "number", min: 16, value: 256 })),
    field("Image (root disk)", h("input", { name: "image", placeholder: "optional image name" })),
    field("Data disk (MiB)", h("input", { name: "disk_mib", type: "number", min: 0, placeholder: "none" })),
    field("Run policy", h("select", { name: "run_policy" },
      ["AlwaysOnUnlessStoppedManually", "Always", "RerunOnFailure", "Manual", "Once", "AlwaysOff"].map((p) => h("option", {}, p)))),
    field("Power", h("select", { name: "power" }, h("option", {}, "Running"), h("option", {}, "Stopped"))),
    field("Readiness", h("input", { name: "readiness", placeholder: "none, console:TEXT, guest-agent…" })),
    field("Stop grace (s)", h("input", { name: "stop_grace_period_s", type: "number", min: 1, placeholder: "60" })),
    field("Node", h("input", { name: "node", placeholder: "any" })),
    h("div", { class: "row-end" },
      h("button", { class: "primary", type: "submit" }, "Create"),
      h("button", { type: "button", onclick: toggleCreate }, "Cancel"),
      h("span", { id: "create-error", class: "error" })));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = new FormData(form);
    const spec = { cpus: Number(f.get("cpus")), memory_mib: Number(f.get("memory_mib")), run_policy: f.get("run_policy"), power: f.get("power") };
    const disks = [];
    if (f.get("image")) disks.push({ name: "root", image: f.get("image") });
    if (Number(f.get("disk_mib")) > 0) disks.push({ name: "data", size_mib: Number(f.get("disk_mib")) });
    if (disks.length) spec.disks = disks;
    if (f.get("readiness")) spec.readiness = f.get("readiness");
    if (f.get("stop_grace_period_s")) spec.stop_grace_period_s = Number(f.get("stop_grace_period_s"));
    if (f.get("node")) spec.node = f.get("node");
    const name = String(f.get("name"));
    try {
      const resp = await api("POST", "/api/v1/vms", { name, spec });
      createOpen = false;
      const goal = spec.power === "Stopped" ? null : goalFor("start", resp.vm);
      state.progress = goal
        ? { name, verb: "create", goal, started: Date.now(), text: `${name}: created` }
        : { name, verb: "create", done: true, text: `${name}: created` };
      document.activeElement?.blur();
      render();
    } catch (err) {
      form.querySelector("#create-error").textContent = err.message;
    }
  });
  return form;
}

// --- a VM's page -----------------------------------------------------------

const details = { name: null, events: [], snapshots: [], migrations: [], error: null };

async function loadDetails(name) {
  try {
    const [events, snapshots, migrations] = await Promise.all([
      api("GET", `/api/v1/events?vm=${enc(name)}`),
      api("GET", `/api/v1/vms/${enc(name)}/snapshots`).catch(() => ({ items: [] })),
      api("GET", `/api/v1/migrations?vm=${enc(name)}`).catch(() => ({ items: [] })),
    ]);
    Object.assign(details, { name, events: events.items ?? [], snapshots: snapshots.items ?? [], migrations: migrations.items ?? [], error: null });
  } catch (err) {
    Object.assign(details, { name, error: err.message });
  }
  render();
}

function vmPage(name) {
  const entry = state.vms.get(name);
  const head = h("div", { class: "page-head" }, h("a", { href: "#/vms" }, "← VMs"), h("h1", {}, name));
  if (!entry) {
    return h("div", {}, head, progressBox(), h("div", { class: "panel empty" }, state.synced ? `No VM named ${name}.` : "Loading…"));
  }
  const { vm, ready, revision } = entry;
  // The history is read again whenever the record changes (the watch
  // says so), not on a timer.
  const key = `${name}@${revision}`;
  if (state.detailsFor !== key) { state.detailsFor = key; loadDetails(name); }
  const s = vm.status;
  const inst = s.instance;
  head.append(badge(s.phase), badge(ready ? "ready" : "not ready", ready ? "ok" : "no"),
    h("div", { class: "actions" },
      powerButtons(name, vm),
      can("snapshot") && h("button", { "data-action": "snapshot", onclick: () => takeSnapshot(name) }, "Snapshot"),
      can("migrate") && inst && h("button", { "data-action": "migrate", onclick: () => migrate(name) }, "Migrate"),
      can("console") && inst && h("button", { class: "primary", "data-action": "console", onclick: () => openConsole(name) }, "Console"),
      can("screen") && inst && vm.spec.boot?.graphics && h("button", { "data-action": "screen", onclick: () => openScreen(name) }, "Screen")));
  const summary = kv([
    ["Phase", badge(s.phase)],
    ["Ready", ready ? "yes" : (inst?.readiness?.reason ?? "no")],
    ["Power (asked)", vm.spec.power],
    ["Run policy", vm.spec.run_policy],
    ["Node", dash(inst?.node)],
    ["Instance", dash(inst?.id)],
    ["Running since", time(inst?.running_since)],
    ["Addresses", addresses(vm)],
    ["Restart required", restartRequired(vm)],
    ["Reason", dash(s.message)],
    ["Last exit", s.last_exit ? JSON.stringify(s.last_exit) : "-"],
    ["Deletion", vm.deletion_requested_at ? `requested ${time(vm.deletion_requested_at)}` : "-"],
  ]);
  const spec = kv([
    ["CPUs", vm.spec.cpus],
    ["Memory", `${vm.spec.memory_mib} MiB`],
    ["Disks", (vm.spec.disks ?? []).map((d) => `${d.name} (${d.size_mib ?? "?"} MiB${d.image ? `, from image ${d.image}` : ""})`).join(", ") || "-"],
    ["Boot", JSON.stringify(vm.spec.boot ?? {})],
    ["Network", JSON.stringify(vm.spec.network ?? {})],
    ["Readiness", typeof vm.spec.readiness === "string" ? vm.spec.readiness : JSON.stringify(vm.spec.readiness)],
    ["Stop grace", `${vm.spec.stop_grace_period_s}s`],
    ["Placement", vm.spec.node ? `node ${vm.spec.node}` : JSON.stringify(vm.spec.placement ?? {})],
    ["Generation", `${vm.generation} (observed ${s.observed_generation})`],
  ]);
  const instances = details.events
    .filter((e) => e.event.to === "Starting" || e.event.to === "Running" || e.event.to === "Stopped")
    .slice(-12).reverse()
    .map((e) => h("tr", {}, h("td", {}, time(e.event.at)), h("td", {}, `${e.event.from} → ${e.event.to}`), h("td", { class: "reason" }, e.event.reason)));
  const events = details.events.slice(-30).reverse().map((e) => h("tr", {},
    h("td", {}, time(e.event.at)), h("td", {}, e.event.audit ? "request" : "phase"),
    h("td", {}, e.audit ? `${e.audit.method ?? ""} ${e.audit.path ?? ""} by ${e.audit.actor ?? "?"}` : `${e.event.from} → ${e.event.to}`),
    h("td", { class: "reason" }, e.event.reason)));
  const snapshots = details.snapshots.map((it) => {
    const snap = it.snapshot;
    return h("tr", { "data-snapshot": snap.name }, h("td", {}, snap.name), h("td", { class: "phase" }, badge(snap.status?.phase ?? "Pending")), h("td", {}, time(snap.status?.taken_at)),
      h("td", {}, can("restore") && h("button", { class: "small", "data-action": "restore", onclick: () => restore(name, snap.name) }, "Restore")));
  });
  const migrations = details.migrations.slice(-10).reverse().map((it) => {
    const m = it.migration ?? it;
    return h("tr", {}, h("td", {}, dash(m.name ?? m.id)), h("td", {}, `${dash(m.source_node ?? m.from)} → ${dash(m.target_node ?? m.to)}`), h("td", {}, badge(m.status?.phase ?? m.phase ?? "-")), h("td", { class: "reason" }, dash(m.status?.message ?? m.message)));
  });
  return h("div", { class: "stack", id: "vm-page", "data-vm": name },
    head, progressBox(),
    details.error && h("p", { class: "error" }, details.error),
    h("div", { class: "grid2" }, panel("Status", h("div", { class: "body" }, summary)), panel("Spec", h("div", { class: "body" }, spec))),
    panel("Instance history", table(["When", "Change", "Reason"], instances, "No instances yet.")),
    h("div", { class: "grid2" },
      panel("Snapshots", table(["Name", "Phase", "Taken", ""], snapshots, "No snapshots.")),
      panel("Migrations", table(["Attempt", "Nodes", "Phase", "Message"], migrations, "No migrations."))),
    panel("Events", table(["When", "Kind", "What", "Reason"], events, "No events.")),
    h("details", { class: "panel" }, h("summary", { class: "section-head" }, h("h2", {}, "Record (JSON)")),
      h("pre", { class: "json" }, JSON.stringify(vm, null, 2))));
}

function addresses(vm) {
  const inst = vm.status.instance;
  // The guest's addresses as its readiness check last read them.
  const found = inst?.readiness?.addresses;
  if (!found || found.length === 0) return "-";
  return found.map((a) => (typeof a === "string" ? a : a.address ?? JSON.stringify(a))).join(", ");
}

async function takeSnapshot(name) {
  const snap = prompt(`Name of the new snapshot of ${name}:`);
  if (!snap) return;
  const progress = { name, verb: "snapshot", text: `${name}: snapshot ${snap} requested`, started: Date.now() };
  state.progress = progress;
  render();
  try {
    await api("POST", `/api/v1/vms/${enc(name)}/snapshots`, { name: snap });
    // A snapshot is its own record, outside the VM watch: this one action
    // is followed until it settles (Ready or Failed), backing off.
    let pause = 500;
    for (;;) {
      const got = await api("GET", `/api/v1/vms/${enc(name)}/snapshots/${enc(snap)}`);
      const phase = got.snapshot.status?.phase ?? "Pending";
      progress.text = `${name}: snapshot ${snap} ${phase}${got.snapshot.status?.message ? `: ${got.snapshot.status.message}` : ""}`;
      if (phase === "Ready") { progress.done = true; break; }
      if (phase === "Failed") { progress.failed = true; break; }
      if (Date.now() - progress.started > WAIT_LIMIT_MS) { progress.failed = true; progress.text += " (timed out waiting)"; break; }
      render();
      await new Promise((r) => setTimeout(r, pause));
      pause = Math.min(pause * 2, 5000);
    }
    loadDetails(name);
  } catch (err) {
    progress.failed = true;
    progress.text = `snapshot of ${name}: ${err.message}`;
  }
  if (state.progress === progress) render();
}

function restore(name, snapshot) {
  if (!confirm(`Restore ${name} from snapshot ${snapshot}? Its disks are replaced.`)) return;
  act(name, "restore", () => api("POST", `/api/v1/vms/${enc(name)}/restore`, { snapshot }));
}

function migrate(name) {
  const to = prompt(`Migrate ${name} to which node? (empty: the scheduler's choice)`);
  if (to === null) return;
  act(name, "migrate", () => api("POST", `/api/v1/vms/${enc(name)}/migrate`, to ? { to } : {}));
}

// --- the serial console ----------------------------------------------------

function openConsole(name) {
  closeConsole();
  if (!/^[A-Za-z0-9._~-]+$/.test(state.token)) {
    $("console-state").textContent = "this token cannot be sent to a WebSocket (unexpected characters)";
    return;
  }
  const panelEl = $("console-panel");
  panelEl.hidden = false;
  const holder = $("terminal");
  holder.replaceChildren();
  const term = new Terminal({ cols: 100, rows: 16, convertEol: false, fontSize: 13, scrollback: 2000 });
  term.open(holder);
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  // The token rides as a subprotocol: browsers cannot set Authorization on
  // a WebSocket, and a URL would leak it into logs (api/ws_auth.rs).
  const ws = new WebSocket(`${scheme}//${location.host}/api/v1/vms/${enc(name)}/console`, ["keel.console", `keel.bearer.${state.token}`]);
  ws.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  $("console-state").textContent = "connecting…";
  panelEl.dataset.state = "connecting";
  ws.onopen = () => { $("console-state").textContent = `attached to ${name}`; panelEl.dataset.state = "open"; term.focus(); };
  ws.onmessage = (ev) => term.write(typeof ev.data === "string" ? ev.data : new Uint8Array(ev.data));
  ws.onclose = (ev) => {
    $("console-state").textContent = `closed${ev.code && ev.code !== 1000 && ev.code !== 1005 ? ` (${ev.code})` : ""}: another session, no instance, or the token may not attach`;
    panelEl.dataset.state = "closed";
  };
  term.onData((data) => { if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data)); });
  state.console = { ws, term, vm: name };
  panelEl.scrollIntoView({ block: "nearest" });
}

function closeConsole() {
  if (!state.console) { $("console-panel").hidden = true; return; }
  state.console.ws.close();
  state.console.term.dispose();
  state.console = null;
  $("console-panel").hidden = true;
}

// --- the graphical console (spec.boot.graphics) ----------------------------

function openScreen(name) {
  closeScreen();
  const panelEl = $("screen-panel");
  if (!/^[A-Za-z0-9._~-]+$/.test(state.token)) {
    panelEl.hidden = false;
    $("screen-state").textContent = "this token cannot be sent to a WebSocket (unexpected characters)";
    return;
  }
  panelEl.hidden = false;
  const holder = $("screen");
  holder.replaceChildren();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  // RFB over the VNC WebSocket (api/vnc.rs), the token offered as a
  // subprotocol beside noVNC's own `binary`, as for the serial console.
  const rfb = new RFB(holder, `${scheme}//${location.host}/api/v1/vms/${enc(name)}/vnc`,
    { wsProtocols: ["binary", `keel.bearer.${state.token}`] });
  rfb.scaleViewport = true;
  rfb.background = "#000";
  $("screen-state").textContent = "connecting…";
  panelEl.dataset.state = "connecting";
  rfb.addEventListener("connect", () => {
    $("screen-state").textContent = `showing ${name}'s screen`;
    panelEl.dataset.state = "connected";
    rfb.focus();
  });
  rfb.addEventListener("disconnect", (ev) => {
    if (state.screen?.rfb !== rfb) return;
    $("screen-state").textContent = ev.detail.clean
      ? "closed"
      : "closed: no instance, no display, another session, or the token may not attach";
    panelEl.dataset.state = "closed";
  });
  state.screen = { rfb, vm: name };
  panelEl.scrollIntoView({ block: "nearest" });
}

function closeScreen() {
  const screen = state.screen;
  state.screen = null;
  $("screen-panel").hidden = true;
  if (screen) screen.rfb.disconnect();
}

// --- nodes, images, events -------------------------------------------------

const listCache = { nodes: null, images: null, events: null };

function fetched(kind, path, pick) {
  if (listCache[kind] === null) {
    listCache[kind] = { loading: true, items: [] };
    api("GET", path)
      .then((d) => { listCache[kind] = { items: pick(d) }; })
      .catch((err) => { listCache[kind] = { error: err.message, items: [] }; })
      .finally(render);
  }
  return listCache[kind];
}

function refreshButton(kind) {
  return h("button", { onclick: () => { listCache[kind] = null; render(); } }, "Refresh");
}

function nodesPage() {
  const data = fetched("nodes", "/api/v1/nodes", (d) => d.items ?? []);
  const rows = data.items.map((it) => {
    const n = it.node;
    const vmsHere = [...state.vms.values()].filter((e) => e.vm.status.instance?.node === n.name).map((e) => e.vm.name);
    const cap = n.status.capacity;
    const drain = n.drain ? (n.drain.completed_at ? `drained ${ago(n.drain.completed_at)}` : `draining since ${ago(n.drain.requested_at)}`) : "-";
    const stateText = n.drain ? (n.drain.completed_at ? "drained" : "draining") : n.cordoned ? "cordoned" : "ready";
    const nodeAct = (verb, body) => async () => {
      try { await api("POST", `/api/v1/nodes/${enc(n.name)}/${verb}`, body); listCache.nodes = null; state.progress = { name: n.name, verb, done: true, text: `node ${n.name}: ${verb} requested` }; }
      catch (err) { state.progress = { name: n.name, verb, failed: true, text: `${verb} ${n.name}: ${err.message}` }; }
      render();
    };
    return h("tr", { "data-node": n.name },
      h("td", {}, n.name), h("td", { class: "state" }, badge(stateText, stateText === "ready" ? "ok" : "warn")),
      h("td", {}, ago(n.status.last_heartbeat)),
      h("td", {}, n.cordoned ? (n.cordoned_by_keel ? "yes (keel)" : "yes (operator)") : "no"),
      h("td", {}, drain), h("td", {}, n.freeze ? `until ${time(n.freeze.until ?? n.freeze.ends_at)}` : "-"),
      h("td", {}, `${it.allocated?.cpus ?? 0} / ${cap?.cpus ?? "-"}`),
      h("td", {}, `${it.allocated?.memory_mib ?? 0} / ${cap?.memory_mib ?? "-"} MiB`),
      h("td", {}, vmsHere.join(", ") || "-"),
      h("td", {},
        can("drain") && !n.drain && h("button", { class: "small", "data-action": "drain", onclick: () => { if (confirm(`Drain node ${n.name}? Its VMs are moved off.`)) nodeAct("drain", {})(); } }, "Drain"),
        can("uncordon") && n.cordoned && h("button", { class: "small", "data-action": "uncordon", onclick: nodeAct("uncordon", {}) }, "Uncordon")));
  });
  return h("div", { class: "stack" },
    h("div", { class: "page-head" }, h("h1", {}, "Nodes"), h("div", { class: "actions" }, refreshButton("nodes"))),
    progressBox(),
    data.error && h("p", { class: "error" }, data.error),
    h("div", { class: "panel" }, table(["Name", "State", "Heartbeat", "Cordoned", "Drain", "Freeze", "CPUs", "Memory", "VMs", ""], rows, data.loading ? "Loading…" : "No nodes.")));
}

function imagesPage() {
  const data = fetched("images", "/api/v1/images", (d) => d.items ?? []);
  const rows = data.items.map((it) => {
    const img = it.image ?? it;
    return h("tr", {}, h("td", {}, img.name), h("td", {}, dash(img.format)),
      h("td", {}, img.virtual_size_mib ? `${img.virtual_size_mib} MiB` : img.size_bytes ? `${Math.round(img.size_bytes / 1048576)} MiB` : "-"),
      h("td", {}, time(img.imported_at ?? img.created_at)), h("td", { class: "reason" }, dash(img.sha256 ?? img.digest)));
  });
  return h("div", { class: "stack" },
    h("div", { class: "page-head" }, h("h1", {}, "Images"), h("div", { class: "actions" }, refreshButton("images"))),
    data.error && h("p", { class: "error" }, data.error),
    h("div", { class: "panel" }, table(["Name", "Format", "Size", "Imported", "Digest"], rows, data.loading ? "Loading…" : "No images.")));
}

function eventsPage() {
  const data = fetched("events", "/api/v1/events", (d) => d.items ?? []);
  const rows = data.items.slice(-200).reverse().map((e) => h("tr", {},
    h("td", {}, time(e.event.at)), h("td", {}, h("a", { href: `#/vm/${enc(e.event.vm)}` }, e.event.vm)),
    h("td", {}, e.audit ? `request by ${e.audit.actor ?? "?"}` : `${e.event.from} → ${e.event.to}`),
    h("td", { class: "reason" }, e.event.reason)));
  return h("div", { class: "stack" },
    h("div", { class: "page-head" }, h("h1", {}, "Events"), h("div", { class: "actions" }, refreshButton("events"))),
    data.error && h("p", { class: "error" }, data.error),
    h("div", { class: "panel" }, table(["When", "VM", "What", "Reason"], rows, data.loading ? "Loading…" : "No events.")));
}

// --- signing in and out ----------------------------------------------------

async function signIn(token) {
  state.token = token;
  const who = await api("GET", "/api/v1/whoami");
  sessionStorage.setItem(TOKEN_KEY, token);
  state.who = who;
  document.body.dataset.role = who.role;
  $("login").hidden = true;
  $("view").hidden = false;
  $("nav").hidden = false;
  $("logout").hidden = false;
  const whoEl = $("who");
  whoEl.hidden = false;
  whoEl.textContent = `${who.name} (${who.role})`;
  if (!location.hash) location.hash = "#/vms";
  watchVms();
  render();
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  state.watch?.abort();
  closeConsole();
  closeScreen();
  Object.assign(state, { token: null, who: null, vms: new Map(), synced: false, watch: null, progress: null, detailsFor: null });
  for (const k of Object.keys(listCache)) listCache[k] = null;
  document.body.dataset.role = "";
  for (const id of ["view", "nav", "logout", "who", "live"]) $(id).hidden = true;
  $("view").replaceChildren();
  $("login").hidden = false;
  $("token").value = "";
  const err = $("login-error");
  err.hidden = !message;
  err.textContent = message ?? "";
}

function start() {
  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const token = $("token").value.trim();
    if (!token) return;
    try {
      await signIn(token);
    } catch (err) {
      signOut(`Sign-in failed: ${err.message}`);
    }
  });
  $("logout").addEventListener("click", () => signOut());
  $("console-close").addEventListener("click", closeConsole);
  $("screen-close").addEventListener("click", closeScreen);
  window.addEventListener("hashchange", () => {
    const { page } = route();
    if (page === "nodes" || page === "images" || page === "events") listCache[page] = null;
    render();
  });
  if (state.token) signIn(state.token).catch(() => signOut("Your session's token was refused: sign in again."));
  else signOut();
}

start();
