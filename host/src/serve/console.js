// The Berth console. Every piece of data reaches the page as text
// (textContent, attribute values), never as markup: job names, policy
// names, notes and details come from callers and guests.
'use strict';

const $ = (s) => document.querySelector(s);
const POLL_MS = 2000;
let token = sessionStorage.getItem('berth-token') || '';
let timer = null;
let last = null;
// What the operator picked, kept across re-renders: "p0/place" -> version.
const chosen = {};
const fractions = {};

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') e.className = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function notice(text, ok) {
  const n = $('#notice');
  n.className = ok ? 'ok' : 'error';
  n.textContent = text;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, body) {
  const opts = { headers: { Authorization: 'Bearer ' + token }, cache: 'no-store' };
  if (body !== undefined) {
    opts.method = 'POST';
    opts.headers['Content-Type'] = 'application/json';
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  let doc = {};
  try { doc = await r.json(); } catch (_) { /* not JSON */ }
  if (!r.ok) throw new ApiError(r.status, doc.error || r.statusText);
  return doc;
}

const ref = (p) => p ? `${p.name}@${p.policy_version} (v${p.version})` : 'none';
const placement = (ps) => (ps || []).map((p) => `${p.node}[${(p.gpus || []).join(',')}]`).join(' ');
const time = (ms) => ms ? new Date(Number(ms)).toLocaleTimeString() : '';

// ---- sign in and out ----

async function signIn(t) {
  token = t;
  try {
    const s = await api('/console/api/state');
    sessionStorage.setItem('berth-token', token);
    $('#login').hidden = true;
    $('#main').hidden = false;
    $('#signout').hidden = false;
    $('#login-error').textContent = '';
    notice('', true);
    render(s);
    refresh();
    clearInterval(timer);
    timer = setInterval(refresh, POLL_MS);
  } catch (e) {
    token = '';
    sessionStorage.removeItem('berth-token');
    $('#login-error').textContent = `Sign-in refused (${e.status || 'network'}): ${e.message}`;
  }
}

function signOut(message) {
  clearInterval(timer);
  timer = null;
  token = '';
  last = null;
  sessionStorage.removeItem('berth-token');
  // Nothing the last identity saw stays on the page.
  for (const tb of document.querySelectorAll('main tbody')) tb.replaceChildren();
  $('#fleet-grid').replaceChildren();
  $('#ab-agreement').replaceChildren();
  $('#ab-latency').replaceChildren();
  $('#ab-gap').replaceChildren();
  $('#ab-partial').replaceChildren();
  $('#whoami').textContent = '';
  $('#updated').textContent = '';
  $('#main').hidden = true;
  $('#signout').hidden = true;
  $('#login').hidden = false;
  $('#token').value = '';
  notice(message || '', true);
}

$('#login').addEventListener('submit', (ev) => {
  ev.preventDefault();
  signIn($('#token').value.trim());
});
$('#signout').addEventListener('click', () => signOut('Signed out.'));

// ---- polling ----

function filterQuery() {
  const q = new URLSearchParams();
  const set = (k, v) => { if (v) q.set(k, v); };
  set('partition', $('#f-partition').value);
  set('job', $('#f-job').value);
  set('version', $('#f-version').value);
  set('arm', $('#f-arm').value);
  set('outcome', $('#f-outcome').value);
  q.set('limit', '100');
  return q.toString();
}

async function refresh() {
  if (!token) return;
  const asked = token;
  try {
    const [s, d, ev] = await Promise.all([api('/console/api/state'), api('/console/api/decisions?' + filterQuery()),
      api('/console/api/decisions?arm=rank&outcome=evicted&limit=50')]);
    // Signed out (or in as someone else) meanwhile: not for this page.
    if (token !== asked) return;
    render(s);
    renderDecisions(d.decisions || []);
    renderPreemptions(ev.decisions || []);
    const p = $('#ab-partition').value;
    if (p) {
      const ab = await api('/console/api/ab?partition=' + encodeURIComponent(p));
      if (token !== asked) return;
      renderAb(ab);
    }
    $('#updated').textContent = 'updated ' + new Date().toLocaleTimeString();
  } catch (e) {
    if (token !== asked) return;
    if (e.status === 401) signOut(`Signed out: ${e.message}`);
    else notice(`Update failed (${e.status || 'network'}): ${e.message}`, false);
  }
}

for (const id of ['#f-partition', '#f-job', '#f-version', '#f-arm', '#f-outcome']) {
  $(id).addEventListener('change', refresh);
}
$('#filters').addEventListener('submit', (ev) => { ev.preventDefault(); refresh(); });
$('#ab-partition').addEventListener('change', refresh);

// ---- operator actions, each confirmed in the page ----

let pending = null;
function confirmAction(text, run) {
  pending = run;
  $('#confirm-text').textContent = text;
  $('#confirm').hidden = false;
  $('#confirm-yes').focus();
}
$('#confirm-no').addEventListener('click', () => { pending = null; $('#confirm').hidden = true; });
$('#confirm-yes').addEventListener('click', async () => {
  const run = pending;
  pending = null;
  $('#confirm').hidden = true;
  if (run) await run();
});

function act(partition, hook, action) {
  const key = `${partition}/${hook}`;
  const version = Number(chosen[key] || 0);
  const fraction = Number(fractions[partition] || 0.5);
  const what = {
    activate: `Activate version ${version} of ${partition} (${hook})?`,
    rollback: `Roll ${partition} (${hook}) back to ${version ? 'version ' + version : 'the previous version'}?`,
    shadow: `Run version ${version} of ${partition} as a shadow candidate (logged, never actuated)?`,
    split: `Let version ${version} decide a ${fraction} share of ${partition}'s jobs for real?`,
    off: `Stop ${partition}'s candidate?`,
  }[action];
  confirmAction(what, async () => {
    try {
      await api('/console/api/action', { partition, hook, action, version, fraction });
      notice(`${action} of ${partition} (${hook}): done`, true);
    } catch (e) {
      notice(`${action} of ${partition} (${hook}) refused (${e.status || 'network'}): ${e.message}`, false);
    }
    refresh();
  });
}

// ---- rendering ----

function render(s) {
  last = s;
  const roles = Object.entries(s.identity.roles || {}).map(([p, r]) => `${p}: ${r || 'none'}`).join(', ');
  $('#whoami').textContent = `Signed in as ${s.identity.name} (${roles})`;
  renderPartitions(s.partitions || []);
  renderFleet(s.fleet || []);
  renderJobs(s.jobs || []);
  renderAccounting(s.accounting || {});
  renderCredits(s.credits || []);
  renderCompactions(s.compactions || []);
  renderPools(s.pools || []);
  for (const sel of [$('#ab-partition'), $('#f-partition')]) {
    const keep = sel.value;
    const names = (s.partitions || []).map((p) => p.name);
    const opts = sel.id === 'f-partition' ? [el('option', { value: '' }, 'any')] : [];
    sel.replaceChildren(...opts, ...names.map((n) => el('option', { value: n }, n)));
    if (keep && names.includes(keep)) sel.value = keep;
    else if (sel.id === 'ab-partition') {
      const withCandidate = (s.partitions || []).find((p) => p.candidate);
      if (withCandidate) sel.value = withCandidate.name;
    }
  }
}

function breakerText(p, history) {
  const now = Date.now();
  const blocked = (history.versions || []).filter((v) => Number(v.blocked_until_unix_ms) > now)
    .map((v) => `v${v.policy.version} blocked ${Math.ceil((Number(v.blocked_until_unix_ms) - now) / 1000)} s`);
  if (p.paused && history === p.place) blocked.unshift('paused: no good version');
  return blocked.length ? blocked.join('; ') : 'closed';
}

function renderPartitions(parts) {
  const rows = [];
  for (const p of parts) {
    const operator = p.role === 'operator';
    for (const hook of p.is_pool ? ['place', 'rank', 'compact', 'pool'] : ['place', 'rank', 'compact']) {
      const h = p[hook] || {};
      const versions = (h.versions || []).map((v) => v.policy);
      const active = hook === 'place' ? p.active : versions.find((v) => v.version === h.active_version);
      const pool = (last && last.pools || []).find((q) => q.partition === p.name);
      let candidate = hook === 'place' && p.candidate
        ? `${p.shadow_mode}${p.shadow_mode === 'split' ? ' ' + p.split_fraction : ''}: ${ref(p.candidate)}` : (hook === 'place' ? 'off' : '-');
      if (hook === 'pool') candidate = pool && pool.candidate ? `shadow: ${ref(pool.candidate)}` : 'off';
      const key = `${p.name}/${hook}`;
      const select = el('select', { 'data-partition': p.name, 'data-hook': hook, class: 'version', 'aria-label': `version of ${key}` },
        ...versions.slice().reverse().map((v) => el('option', { value: v.version }, `v${v.version} ${v.name}@${v.policy_version}`)));
      if (chosen[key] && versions.some((v) => String(v.version) === String(chosen[key]))) select.value = chosen[key];
      chosen[key] = select.value;
      select.addEventListener('change', () => { chosen[key] = select.value; });
      const button = (action, label) => {
        const b = el('button', { type: 'button', class: 'act' + (operator ? '' : ' viewer'), 'data-action': action, 'data-partition': p.name, 'data-hook': hook,
          title: operator ? '' : 'needs the operator role: the server refuses it' }, label);
        b.addEventListener('click', () => act(p.name, hook, action));
        return b;
      };
      const actions = el('td', {}, select, button('activate', 'Activate'), button('rollback', 'Rollback'));
      if (hook === 'place') {
        const frac = el('input', { type: 'number', min: '0.05', max: '1', step: '0.05', class: 'fraction', 'data-partition': p.name, 'aria-label': 'split fraction' });
        frac.value = fractions[p.name] || '0.5';
        frac.addEventListener('change', () => { fractions[p.name] = frac.value; });
        actions.append(button('shadow', 'Shadow'), button('split', 'Split'), frac, button('off', 'Off'));
      } else if (hook === 'pool') {
        actions.append(button('shadow', 'Shadow'), button('off', 'Off'));
      }
      const events = (h.events || []).map((e) => el('li', {}, `${time(e.unix_ms)} ${e.kind} v${e.version} by ${e.by}${e.detail ? ': ' + e.detail : ''}`));
      const history = el('details', {}, el('summary', {}, `${(h.events || []).length} latest events`), el('ul', {}, ...events));
      rows.push(el('tr', { 'data-partition': p.name, 'data-hook': hook },
        el('td', {}, hook === 'place' ? `${p.name} (${p.nodes} nodes, ${p.gpus} GPUs)` : p.name),
        el('td', {}, p.role || 'none'),
        el('td', {}, hook),
        el('td', { class: 'active' }, !active && hook === 'rank' ? 'default ranking' : (!active && hook === 'compact' ? 'none (no compaction)'
          : (!active && hook === 'pool' ? 'default placement and step' : ref(active)))),
        el('td', { class: 'candidate' }, candidate),
        el('td', { class: 'breaker' }, breakerText(p, h)),
        el('td', {}, history),
        actions));
    }
  }
  fill($('#partitions tbody'), rows);
}

function renderFleet(nodes) {
  const counts = { free: 0, used: 0, shared: 0, held: 0, unhealthy: 0 };
  const groups = new Map();
  for (const n of nodes) {
    const key = `${n.partition} · switch ${n.switch_domain}`;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(n);
    for (const g of n.gpus) counts[g] = (counts[g] || 0) + 1;
  }
  const partial = nodes.filter((n) => n.partial).length;
  $('#fleet-summary').textContent = `${nodes.length} nodes; GPUs: ` +
    Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(', ') + `; ${partial} partly used nodes`;
  const domains = [];
  for (const [key, list] of groups) {
    const cells = list.map((n) => el('div', {
      class: 'node' + (n.partial ? ' partial' : '') + (n.schedulable ? '' : ' unschedulable'),
      'data-node': n.name, title: `${n.name} ${n.model} (${n.state})${n.schedulable ? '' : ', not schedulable'}`,
    }, n.name, el('div', { class: 'gpus' }, ...n.gpus.map((g, i) => el('i', { class: 'gpu ' + g, title: `GPU ${i}: ${g}` })))));
    domains.push(el('div', { class: 'domain', 'data-domain': key }, el('h3', {}, key), el('div', { class: 'nodes' }, ...cells)));
  }
  $('#fleet-grid').replaceChildren(el('div', { class: 'domains' }, ...domains));
}

function renderJobs(jobs) {
  fill($('#jobs tbody'), jobs.map((j) => {
    const s = j.spec || {};
    let why = '';
    if (j.state === 'pending') {
      why = j.explain ? j.explain.summary : (j.detail || '');
      if (Number(j.reserved_until_s) > 0) why += ` (reserved: starts by ${new Date(Number(j.reserved_until_s) * 1000).toLocaleTimeString()})`;
    } else if (j.detail) {
      why = j.detail;
    }
    return el('tr', { class: j.state, 'data-job': j.id },
      el('td', { class: 'num' }, j.id), el('td', {}, s.partition), el('td', {}, j.owner), el('td', { class: 'name' }, s.name || ''),
      el('td', { class: 'state' }, j.state === 'running' && j.sleep && j.sleep !== 'awake' ? j.sleep : j.state), el('td', { class: 'num' }, s.tasks), el('td', { class: 'num' }, s.gpus),
      el('td', { class: 'num' }, s.priority), el('td', { class: 'placement' }, placement(j.placements)),
      el('td', { class: 'num' }, j.policy_version || ''), el('td', { class: 'why' }, why));
  }));
}

function renderAccounting(a) {
  const f = (x) => Number(x || 0).toFixed(1);
  fill($('#acct tbody'), (a.rows || []).map((r) => {
    const g = r.gpus || {};
    const pct = g.healthy ? (100 * g.busy / g.healthy).toFixed(1) + ' %' : '-';
    return el('tr', { 'data-group': r.group }, el('td', {}, r.group), el('td', { class: 'num' }, f(g.installed)), el('td', { class: 'num' }, f(g.powered)),
      el('td', { class: 'num' }, f(g.healthy)), el('td', { class: 'num' }, f(g.schedulable)), el('td', { class: 'num' }, f(g.busy)), el('td', { class: 'num' }, f(g.productive)),
      el('td', { class: 'num' }, f(g.reclaimable)), el('td', { class: 'num' }, pct));
  }));
  fill($('#stranded tbody'), (a.stranded || []).map((s) => el('tr', {}, el('td', {}, s.cause), el('td', { class: 'num' }, f(s.gpus)))));
  const outcome = a.outcome || [];
  const g4 = (x) => Number(x || 0).toPrecision(4);
  fill($('#outcome tbody'), outcome.map((o) => el('tr', { 'data-group': o.group, 'data-unit': o.unit }, el('td', {}, o.group), el('td', {}, o.unit),
    el('td', { class: 'num' }, String(o.done || 0)), el('td', { class: 'num' }, String(o.lost || 0)), el('td', { class: 'num' }, String(o.goodput || 0)),
    el('td', { class: 'num' }, f(o.installed_gpu_hours)), el('td', { class: 'num' }, g4(o.per_installed_gpu_hour)),
    el('td', { class: 'num' }, o.has_cost ? g4(o.per_cost) : '-'))));
  $('#outcome-empty').hidden = outcome.length > 0;
}

function renderCredits(rows) {
  const f = (x) => Number(x || 0).toFixed(2);
  fill($('#credits tbody'), rows.map((c) => el('tr', { 'data-tenant': c.tenant }, el('td', {}, c.partition), el('td', {}, c.tenant),
    el('td', { class: 'num' }, String(c.preemptions || 0)), el('td', { class: 'num' }, f((c.lost_gpu_seconds || 0) / 3600)),
    el('td', { class: 'num' }, String(c.broken_promises || 0)), el('td', { class: 'num' }, f(c.credit_gpu_hours)))));
  $('#credits-empty').hidden = rows.length > 0;
}

function renderDecisions(ds) {
  fill($('#decisions tbody'), ds.map((d) => el('tr', { 'data-decision': d.id, 'data-arm': d.arm },
    el('td', { class: 'num' }, d.id), el('td', {}, time(d.unix_ms)), el('td', {}, d.partition), el('td', { class: 'num' }, d.job_id),
    el('td', {}, d.arm + (d.actuated ? '' : ' (not actuated)')), el('td', {}, `${d.policy}@${d.policy_semver} v${d.policy_version}`),
    el('td', {}, d.outcome), el('td', {}, placement(d.placements)), el('td', { class: 'num' }, d.latency_us), el('td', {}, d.detail))));
}

function renderCompactions(chains) {
  const bytes = (c) => Number(c.bytes_same_switch || 0) + Number(c.bytes_same_aggregation || 0) + Number(c.bytes_cross_aggregation || 0);
  const gib = (b) => (b / 2 ** 30).toFixed(1) + ' GiB';
  const rows = chains.map((c) => {
    const moves = c.moves || [];
    const done = moves.filter((m) => m.state === 'done').length;
    const list = el('details', {}, el('summary', {}, `${moves.length} planned`),
      el('ul', {}, ...moves.map((m) => el('li', {}, `job ${m.job_id}: ${m.from_node} → ${m.to_node} (${m.state}${m.cause ? ': ' + m.cause : ''})`))));
    return el('tr', { 'data-chain': c.id, 'data-state': c.state },
      el('td', { class: 'num' }, c.id), el('td', {}, c.partition), el('td', {}, c.policy), el('td', { class: 'state' }, c.state),
      el('td', {}, time(c.started_unix_ms)), el('td', { class: 'num' }, done), el('td', { class: 'num' }, c.nodes_freed || 0),
      el('td', { class: 'num' }, `${c.idle_nodes_before || 0} → ${c.idle_nodes_after || 0}`), el('td', { class: 'num' }, gib(bytes(c))),
      el('td', {}, list), el('td', {}, c.cause || ''));
  });
  fill($('#compactions tbody'), rows.length ? rows : [el('tr', {}, el('td', { colspan: 11, class: 'muted' }, 'no compaction chain has run'))]);
}

// Each pool partition: its requests against the SLO, then one row per
// executor (where it runs, what it serves, who chose its steps, and what a
// candidate in shadow would have chosen).
function renderPools(pools) {
  $('#pools').hidden = pools.length === 0;
  const secs = (v) => Number(v || 0).toFixed(3) + ' s';
  const blocks = pools.map((q) => {
    const r = q.requests || {};
    const l = q.latency || {};
    const judged = Number(r.slo_met || 0) + Number(r.slo_missed || 0);
    const attained = judged ? (100 * Number(r.slo_met || 0) / judged).toFixed(1) + '%' : '-';
    const summary = el('table', { class: 'pool-summary', 'data-partition': q.partition }, el('tbody', {},
      el('tr', {}, el('th', {}, 'Placed by'), el('td', {}, q.placed_by || 'not yet')),
      el('tr', {}, el('th', {}, 'Pool version'), el('td', {}, ref(q.active) === 'none' ? 'default placement and step' : ref(q.active))),
      el('tr', {}, el('th', {}, 'Candidate in shadow'), el('td', {}, ref(q.candidate))),
      el('tr', {}, el('th', {}, 'Requests'), el('td', { class: 'requests' },
        `${r.slo_met || 0} met the SLO, ${r.slo_missed || 0} missed (${attained} attained), ${r.failed || 0} failed, ${r.rejected || 0} rejected, ${r.cancelled || 0} cancelled; ${r.in_flight || 0} in flight`)),
      el('tr', {}, el('th', {}, 'TTFT p50 / p99'), el('td', {}, `${secs(l.ttft_p50_s)} / ${secs(l.ttft_p99_s)} (SLO ${l.slo_ttft_s} s)`)),
      el('tr', {}, el('th', {}, 'TBT p50 / p99'), el('td', {}, `${secs(l.tbt_p50_s)} / ${secs(l.tbt_p99_s)} (SLO ${l.slo_tbt_s} s)`))));
    const rows = (q.executors || []).map((e) => {
      const st = e.steps || {};
      const sh = e.shadow || {};
      const recent = e.recent || [];
      const latest = recent.length ? recent[recent.length - 1] : null;
      const steps = el('details', {}, el('summary', {}, latest ? `${latest.phase} ${latest.model} by ${latest.by}` : 'none yet'),
        el('ul', {}, ...recent.slice().reverse().map((x) => el('li', {},
          `t=${Number(x.t).toFixed(2)} ${x.phase} ${x.model} batch ${x.batch} ×${x.iterations} by ${x.by}${x.why ? ' (' + x.why + ')' : ''}${x.shadow ? '; candidate ' + x.shadow : ''}`))));
      return el('tr', { 'data-executor': e.index, 'data-state': e.state },
        el('td', { class: 'num' }, e.index), el('td', { class: 'num' }, e.tp), el('td', { class: 'state' }, e.state),
        el('td', {}, e.node ? `${e.node} (#${e.allocation_id})` : '-'), el('td', { class: 'num' }, e.load),
        el('td', {}, (e.models || []).map((m) => `${m.model}×${m.weight}${m.pinned ? ' pinned' : ''}`).join(', ') || 'none'),
        el('td', { class: 'num steps' }, `${st.policy || 0} / ${st.default || 0} / ${st.fallback || 0}`),
        el('td', { class: 'num' }, `${sh.agreed || 0} / ${sh.differed || 0} / ${sh.refused || 0}`),
        el('td', {}, steps));
    });
    const table = el('table', { class: 'pool-executors', 'data-partition': q.partition },
      el('thead', {}, el('tr', {}, ...['#', 'TP', 'State', 'Node', 'Load', 'Models (weight)', 'Steps: policy / default / fallback', 'Candidate: agreed / differed / refused', 'Latest steps']
        .map((t, i) => el('th', i === 0 || i === 1 || i === 4 || i === 6 || i === 7 ? { class: 'num' } : {}, t)))),
      el('tbody', {}, ...rows));
    return el('div', { class: 'pool' }, el('h3', {}, `${q.partition}: ${q.models} models`), summary, table);
  });
  $('#pools-list').replaceChildren(...blocks);
}

function renderPreemptions(ds) {
  fill($('#preemptions tbody'), ds.map((d) => el('tr', { 'data-decision': d.id },
    el('td', { class: 'num' }, d.id), el('td', {}, time(d.unix_ms)), el('td', {}, d.partition), el('td', { class: 'num' }, d.job_id),
    el('td', {}, d.policy_version ? `${d.policy}@${d.policy_semver} v${d.policy_version}` : d.policy), el('td', {}, d.detail))));
}

const ARM_COLOURS = { active: '#2563eb', shadow: '#d97706', candidate: '#16a34a' };

function renderAb(r) {
  const n = (x, d) => Number(x || 0).toFixed(d === undefined ? 2 : d);
  const rows = [
    ['Mode', r.mode], ['Active', ref(r.active)], ['Candidate', ref(r.candidate)], ['Shadow samples', r.samples],
    ['Agreement rate', n(r.agreement_rate, 3)], ['Candidate score gap (its pick over the active\'s)', n(r.mean_candidate_score_gap)],
    ['Active score gap', n(r.mean_active_score_gap)], ['Partly used nodes after (active / candidate)', `${n(r.mean_partial_nodes_active)} / ${n(r.mean_partial_nodes_candidate)}`],
    ['Switch domains per gang (active / candidate)', `${n(r.mean_domains_active)} / ${n(r.mean_domains_candidate)}`], ['Candidate errors', r.candidate_errors || 0],
  ];
  fill($('#ab-summary tbody'), rows.map(([k, v]) => el('tr', {}, el('th', {}, k), el('td', { class: 'ab-value' }, v))));
  const armRows = (r.arms || []).map((a) => el('tr', { 'data-arm': a.arm }, el('td', {}, a.arm), el('td', {}, ref(a.policy)),
    el('td', { class: 'num' }, a.decisions || 0), el('td', { class: 'num' }, a.placed || 0), el('td', { class: 'num' }, a.errors || 0),
    el('td', { class: 'num' }, n(a.mean_latency_us, 0)), el('td', { class: 'num' }, n(a.mean_wait_s)), el('td', { class: 'num' }, n(a.mean_partial_nodes_after))));
  fill($('#ab-arms tbody'), armRows.length ? armRows : [el('tr', {}, el('td', { colspan: 8, class: 'muted' }, 'in split mode only'))]);
  fill($('#ab-diffs tbody'), (r.recent_diffs || []).map((d) => el('tr', {}, el('td', { class: 'num' }, d.decision_id), el('td', { class: 'num' }, d.job_id),
    el('td', {}, placement(d.active)), el('td', {}, placement(d.candidate)), el('td', {}, d.note))));
  const s = r.series || {};
  plotAgreement(s.agreement || []);
  plotLatency(s.latency_buckets_us || [], s.latency || {});
  const points = r.points || [];
  plotLines('#ab-gap', 'score gap', points, [
    { name: 'candidate', colour: ARM_COLOURS.shadow, value: (p) => p.candidate_gap },
    { name: 'active', colour: ARM_COLOURS.active, value: (p) => p.active_gap }]);
  plotLines('#ab-partial', 'partly used nodes', points, [
    { name: 'candidate', colour: ARM_COLOURS.shadow, value: (p) => p.partial_candidate },
    { name: 'active', colour: ARM_COLOURS.active, value: (p) => p.partial_active }]);
}

// One line per series over the shadow samples (a sample a series has no
// value for is skipped).
function plotLines(id, yLabel, points, series) {
  const svg = $(id);
  const values = series.map((s) => points.map((p) => { const v = s.value(p); return v === null || v === undefined ? null : Number(v); }));
  const max = Math.max(1e-9, ...values.flat().filter((v) => v !== null));
  const h = PLOT.bottom - PLOT.top;
  const fmt = (v) => max >= 10 ? Math.round(v) : v.toFixed(2);
  const x = sampleAxes(svg, yLabel, [0, 0.5, 1].map((v) => [PLOT.bottom - v * h, fmt(v * max)]), points.length);
  if (!x) return;
  series.forEach((s, k) => {
    const line = values[k].map((v, i) => v === null ? null : `${x(i).toFixed(1)},${(PLOT.bottom - (v / max) * h).toFixed(1)}`).filter((p) => p).join(' ');
    if (line) svg.append(svgEl('polyline', { class: 'series', 'data-series': s.name, points: line, fill: 'none', stroke: s.colour, 'stroke-width': 2 }));
    svg.append(svgEl('rect', { x: PLOT.left + 10 + k * 110, y: 204, width: 10, height: 10, fill: s.colour }));
    svg.append(svgEl('text', { x: PLOT.left + 24 + k * 110, y: 213, class: 'legend' }, s.name));
  });
}

// Plot area of both plots, in the SVG's own units.
const PLOT = { left: 44, right: 548, top: 22, bottom: 178 };

function axes(svg, yLabel, ticks) {
  svg.append(svgEl('line', { x1: PLOT.left, y1: PLOT.bottom, x2: PLOT.right, y2: PLOT.bottom, stroke: '#8a91a0' }));
  svg.append(svgEl('line', { x1: PLOT.left, y1: PLOT.top, x2: PLOT.left, y2: PLOT.bottom, stroke: '#8a91a0' }));
  for (const [y, label] of ticks) {
    svg.append(svgEl('line', { x1: PLOT.left - 3, y1: y, x2: PLOT.right, y2: y, stroke: '#eceef2' }));
    svg.append(svgEl('text', { x: PLOT.left - 5, y: y + 4, 'text-anchor': 'end' }, label));
  }
  svg.append(svgEl('text', { x: 4, y: 12 }, yLabel));
}

// Clears `svg` and draws axes over `n` shadow samples; returns the x of
// sample i, or null (and says so in the plot) when there are none.
function sampleAxes(svg, yLabel, ticks, n) {
  svg.replaceChildren();
  axes(svg, yLabel, ticks);
  svg.append(svgEl('text', { x: PLOT.right, y: 200, 'text-anchor': 'end' }, `shadow samples (${n})`));
  if (!n) {
    svg.append(svgEl('text', { x: 200, y: 100, class: 'empty' }, 'no shadow samples yet'));
    return null;
  }
  const w = PLOT.right - PLOT.left;
  return (i) => PLOT.left + (n === 1 ? w / 2 : (i * w) / (n - 1));
}

function plotAgreement(points) {
  const svg = $('#ab-agreement');
  const h = PLOT.bottom - PLOT.top;
  const x = sampleAxes(svg, 'agree', [0, 0.5, 1].map((v) => [PLOT.bottom - v * h, v.toFixed(1)]), points.length);
  if (!x) return;
  const y = (r) => PLOT.bottom - r * h;
  const line = points.map((p, i) => `${x(i).toFixed(1)},${y(p.rate).toFixed(1)}`).join(' ');
  svg.append(svgEl('polyline', { id: 'ab-agree-line', points: line, fill: 'none', stroke: '#2563eb', 'stroke-width': 2 }));
  // One mark per sample (the newest 400): filled where the arms agreed.
  const from = Math.max(0, points.length - 400);
  points.slice(from).forEach((p, k) => {
    svg.append(svgEl('circle', { cx: x(from + k), cy: y(p.rate), r: 2.5, class: p.agree ? 'agree' : 'differ',
      fill: p.agree ? '#2563eb' : '#fff', stroke: '#2563eb' }));
  });
}

function plotLatency(bounds, byArm) {
  const svg = $('#ab-latency');
  svg.replaceChildren();
  const arms = Object.keys(byArm);
  const buckets = bounds.length + 1;
  const max = Math.max(1, ...arms.flatMap((a) => byArm[a]));
  const h = PLOT.bottom - PLOT.top;
  axes(svg, 'count', [0, 0.5, 1].map((v) => [PLOT.bottom - v * h, Math.round(v * max)]));
  const slot = (PLOT.right - PLOT.left) / buckets;
  const bar = (slot - 6) / Math.max(1, arms.length);
  const label = (us) => us >= 1000 ? `${us / 1000}ms` : `${us}µs`;
  for (let b = 0; b < buckets; b++) {
    const text = b < bounds.length ? '≤' + label(bounds[b]) : '>' + label(bounds[bounds.length - 1]);
    svg.append(svgEl('text', { x: PLOT.left + b * slot + slot / 2, y: PLOT.bottom + 14, 'text-anchor': 'middle' }, text));
    arms.forEach((a, k) => {
      const c = byArm[a][b] || 0;
      if (!c) return;
      const bh = (c / max) * h;
      svg.append(svgEl('rect', { x: PLOT.left + b * slot + 3 + k * bar, y: PLOT.bottom - bh, width: Math.max(1, bar - 1), height: bh,
        fill: ARM_COLOURS[a] || '#6b7383', class: 'bar', 'data-arm': a, 'data-count': c }));
    });
  }
  arms.forEach((a, k) => {
    svg.append(svgEl('rect', { x: PLOT.left + 10 + k * 110, y: 204, width: 10, height: 10, fill: ARM_COLOURS[a] || '#6b7383' }));
    svg.append(svgEl('text', { x: PLOT.left + 24 + k * 110, y: 213, class: 'legend' }, a));
  });
}

if (token) signIn(token);
