// idem live dashboard.
//
// Polls the admin listener's Prometheus endpoint (/metrics), turns counter
// deltas between polls into per-second rates, and draws rolling charts on
// <canvas> with a few dozen lines of our own drawing code; the counters'
// own values give the totals since the gateway started. A record inspector
// and a list of processing records use /api/v1/records. No dependencies.
//
// Hooks for browser tests: the element ids in index.html, and on <body>
// data-polls (successful /metrics polls) and data-total-requests (sum of
// idem_requests_total at the last poll).
'use strict';

// ---- Settings --------------------------------------------------------------

const POLL_MS = 1000;            // /metrics poll period
const RECORDS_POLL_MS = 5000;    // processing-records list refresh period
const WINDOW_S = 300;            // charts show the last 5 minutes
const SMOOTH_S = 5;              // tiles and ratio lines average this many seconds
const SMOOTH_N = Math.max(1, Math.round((SMOOTH_S * 1000) / POLL_MS)); // ... that many polls
const FETCH_TIMEOUT_MS = 4000;
const GAP_MS = POLL_MS * 3.5;    // a longer silence between points breaks the line
const TOKEN_KEY = 'idem.adminToken';

// One stable colour per outcome; the order is also the stacking order.
const OUTCOMES = {
  executed: '#2e7d32', replayed: '#1565c0', in_progress: '#ef6c00',
  mismatch: '#c62828', outcome_unknown: '#263238', store_error: '#795548',
  unprotected: '#f9a825', missing_key: '#8e24aa', invalid_key: '#ba68c8',
  bad_request: '#d81b60', unverified: '#6d4c41', pass_through: '#b0bec5',
};

const $ = (id) => document.getElementById(id);

// ---- Admin token -----------------------------------------------------------
// Taken from `#token=...` once (then scrubbed from the URL), or from the form
// shown on a 401. Kept in sessionStorage: it lives as long as this tab.

class AuthError extends Error {}
let awaitingToken = false;

function takeTokenFromHash() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ''));
  const token = params.get('token');
  if (token) {
    sessionStorage.setItem(TOKEN_KEY, token);
    history.replaceState(null, '', location.pathname + location.search);
  }
}

function askForToken(rejected) {
  if (rejected) sessionStorage.removeItem(TOKEN_KEY);
  awaitingToken = true;
  $('token-form').hidden = false;
  $('token-note').textContent = rejected ? 'the token was rejected' : '';
  setStatus('token required', 'auth');
}

$('token-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const token = $('token-input').value.trim();
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  $('token-input').value = '';
  $('token-form').hidden = true;
  awaitingToken = false;
  setStatus('connecting…', '');
  pollProcessingSafely();
});

// fetch() with the Bearer token and a timeout; a 401 raises AuthError.
async function api(path) {
  const headers = { Accept: 'application/json, text/plain' };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  try {
    const resp = await fetch(path, { headers, signal: ctl.signal, cache: 'no-store' });
    if (resp.status === 401) {
      askForToken(Boolean(token));
      throw new AuthError('token required');
    }
    return resp;
  } catch (err) {
    if (err.name === 'AbortError') throw new Error(`${path}: no answer in ${FETCH_TIMEOUT_MS / 1000} s`);
    throw err;
  } finally {
    clearTimeout(timer);
  }
}

// A one-line description of a failed response (RFC 9457 problem+json if any).
async function problemText(resp) {
  const text = await resp.text().catch(() => '');
  try {
    const p = JSON.parse(text);
    return [`${resp.status} ${p.title || ''}`.trim(), p.detail].filter(Boolean).join(': ');
  } catch {
    return `${resp.status} ${text.trim().slice(0, 200)}`.trim();
  }
}

function setStatus(text, kind) {
  const el = $('status');
  el.textContent = text;
  el.className = `status ${kind}`;
}

// ---- Prometheus text format ------------------------------------------------

const SPECIAL = { '+Inf': Infinity, Inf: Infinity, '-Inf': -Infinity };
const parseValue = (s) => (s in SPECIAL ? SPECIAL[s] : Number(s));

// One sample line: name{label="value",...} value [timestamp]. Label values
// may hold spaces, '/', ',' , '}' and the escapes \" \\ \n. Returns null for
// lines it cannot read (they are skipped, not fatal).
function parseSample(line) {
  let i = 0;
  while (i < line.length && !' \t{'.includes(line[i])) i++;
  const name = line.slice(0, i);
  const labels = {};
  if (line[i] === '{') {
    i++;
    for (;;) {
      while (line[i] === ' ' || line[i] === ',') i++;
      if (line[i] === '}') { i++; break; }
      const eq = line.indexOf('=', i);
      if (eq < 0 || line[eq + 1] !== '"') return null;
      const label = line.slice(i, eq).trim();
      let value = '';
      for (i = eq + 2; i < line.length && line[i] !== '"'; i++) {
        if (line[i] === '\\' && i + 1 < line.length) {
          const c = line[++i];
          value += c === 'n' ? '\n' : c;
        } else {
          value += line[i];
        }
      }
      if (i >= line.length) return null; // unterminated value
      i++;
      labels[label] = value;
    }
  }
  const token = line.slice(i).trim().split(/\s+/)[0];
  if (!name || !token) return null;
  const value = parseValue(token);
  return Number.isNaN(value) && token !== 'NaN' ? null : { name, labels, value };
}

function labelKey(labels, skip) {
  return JSON.stringify(Object.keys(labels).filter((k) => k !== skip).sort().map((k) => [k, labels[k]]));
}

// A parsed scrape, indexed by series (name + labels) and by metric name.
function parseMetrics(text) {
  const byKey = new Map();
  const byName = new Map();
  for (const raw of text.split('\n')) {
    const line = raw.trim();
    if (!line || line.startsWith('#')) continue; // HELP, TYPE, comments
    const s = parseSample(line);
    if (!s) continue;
    s.key = s.name + labelKey(s.labels);
    byKey.set(s.key, s);
    if (!byName.has(s.name)) byName.set(s.name, []);
    byName.get(s.name).push(s);
  }
  return { byKey, list: (name) => byName.get(name) || [] };
}

// Sum of a gauge over its series, or null when the metric is absent.
function gauge(snap, name) {
  const list = snap.list(name);
  return list.length ? list.reduce((a, s) => a + s.value, 0) : null;
}

// The sum of a counter's series whose labels pass `keep` (all by default).
function total(snap, name, keep = () => true) {
  return snap.list(name).filter((s) => keep(s.labels)).reduce((a, s) => a + s.value, 0);
}

// Increase of one counter series since the previous scrape. A series that is
// new, or went down (the process restarted), counts its whole current value.
function increase(s, prev, reset = false) {
  const p = prev.byKey.get(s.key);
  if (!p || reset || s.value < p.value) return s.value;
  return s.value - p.value;
}

// Bucket increases of histogram `base`, summed over all its series by `le`:
// a sorted list of [upper bound, cumulative count]. A series whose _count
// went down is treated as reset as a whole, so its buckets stay consistent.
function histogramIncrease(cur, prev, base) {
  const reset = new Set();
  for (const s of cur.list(`${base}_count`)) {
    const p = prev.byKey.get(s.key);
    if (p && s.value < p.value) reset.add(labelKey(s.labels));
  }
  const byLe = new Map();
  for (const s of cur.list(`${base}_bucket`)) {
    const le = parseValue(s.labels.le);
    const d = increase(s, prev, reset.has(labelKey(s.labels, 'le')));
    byLe.set(le, (byLe.get(le) || 0) + d);
  }
  return [...byLe].sort((a, b) => a[0] - b[0]);
}

function mergeBuckets(lists) {
  const byLe = new Map();
  for (const list of lists) for (const [le, c] of list) byLe.set(le, (byLe.get(le) || 0) + c);
  return [...byLe].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of cumulative buckets, as PromQL's histogram_quantile does
// it: find the bucket holding rank q*total and interpolate linearly inside
// it (the first bucket starts at 0; a rank in +Inf answers the highest
// finite bound). Null when nothing was observed.
function quantile(q, buckets) {
  if (!buckets.length || buckets[buckets.length - 1][0] !== Infinity) return null;
  const total = buckets[buckets.length - 1][1];
  if (!(total > 0)) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [le, cum] of buckets) {
    if (cum >= rank) {
      if (le === Infinity) return lower;
      if (lower === 0 && le <= 0) return le;
      const inBucket = cum - below;
      return inBucket > 0 ? lower + (le - lower) * ((rank - below) / inBucket) : lower;
    }
    lower = le;
    below = cum;
  }
  return lower;
}

// ---- State, one point per poll ---------------------------------------------

const state = {
  prev: null,        // previous scrape
  prevAt: 0,
  polls: 0,
  points: [],        // {t, dt, req: {route: {outcome: increase}}, buckets, gauges}
  version: null,
  routes: new Set(),
};

function takePoint(cur, prev, t, dt) {
  const req = {};
  for (const s of cur.list('idem_requests_total')) {
    const { route = '?', outcome = '?' } = s.labels;
    req[route] = req[route] || {};
    req[route][outcome] = (req[route][outcome] || 0) + increase(s, prev);
  }
  return {
    t, dt, req,
    buckets: histogramIncrease(cur, prev, 'idem_store_op_seconds'),
    processing: gauge(cur, 'idem_records_processing'),
    stuck: gauge(cur, 'idem_stuck_records'),
    outboxPending: gauge(cur, 'idem_outbox_pending'),
    outboxLag: gauge(cur, 'idem_outbox_lag_seconds'),
  };
}

// Increases by outcome in one point, for `route` (or all routes when empty).
const outcomesOf = (p, route) => sumOutcomes(Object.entries(p.req).filter(([r]) => !route || r === route).map(([, o]) => o));

// Adds up a list of {outcome: increase}.
function sumOutcomes(list) {
  const out = {};
  for (const x of list) for (const [o, v] of Object.entries(x)) out[o] = (out[o] || 0) + v;
  return out;
}

const ratio = (n, d) => (d > 0 ? n / d : null);
const sum = (o, keys) => keys.reduce((a, k) => a + (o[k] || 0), 0);
const protectedTotal = (o) => Object.entries(o).reduce((a, [k, v]) => (k === 'pass_through' ? a : a + v), 0);
const replayRate = (o) => ratio(o.replayed || 0, sum(o, ['executed', 'replayed']));
const duplicateRate = (o) => ratio(sum(o, ['replayed', 'in_progress', 'mismatch']), protectedTotal(o));

async function pollMetrics() {
  if (awaitingToken) return;
  const resp = await api('/metrics');
  if (!resp.ok) throw new Error(`/metrics: ${await problemText(resp)}`);
  const cur = parseMetrics(await resp.text());
  const now = Date.now();
  if (state.prev) state.points.push(takePoint(cur, state.prev, now, (now - state.prevAt) / 1000));
  [state.prev, state.prevAt] = [cur, now];
  while (state.points.length && state.points[0].t < now - (WINDOW_S + 10) * 1000) state.points.shift();

  const info = cur.list('idem_build_info')[0];
  state.version = info ? info.labels.version : null;
  let total = 0;
  for (const s of cur.list('idem_requests_total')) {
    total += s.value;
    addRoute(s.labels.route);
  }
  state.polls += 1;
  document.body.dataset.polls = String(state.polls);
  document.body.dataset.totalRequests = String(total);
  render();
  setStatus(`ok · ${new Date(now).toLocaleTimeString()}`, 'ok');
}

function addRoute(route) {
  if (route === undefined || state.routes.has(route)) return;
  state.routes.add(route);
  const opt = document.createElement('option');
  opt.value = opt.textContent = route;
  $('route-filter').append(opt);
}

// ---- Formatting ------------------------------------------------------------

function num(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return '–';
  const a = Math.abs(v);
  if (a >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
  if (a >= 1e4) return `${+(v / 1e3).toFixed(1)}k`;
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return String(+v.toFixed(1));
  return String(+v.toFixed(2));
}
// A whole count, every digit kept: totals are read exactly.
const count = (v) => Math.round(v).toLocaleString('en');
const perSec = (v) => (v === null ? '–' : `${num(v)}/s`);
const pct = (v) => (v === null ? '–' : `${num(v * 100)}%`);
const ms = (v) => (v === null ? '–' : `${num(v)} ms`);
const secs = (v) => (v === null ? '–' : `${num(v)} s`);

function ago(iso) {
  const s = Math.round((Date.now() - Date.parse(iso)) / 1000);
  if (!Number.isFinite(s)) return '';
  const a = Math.abs(s);
  const text = a < 90 ? `${a}s` : a < 5400 ? `${Math.round(a / 60)}m` : a < 172800 ? `${Math.round(a / 3600)}h` : `${Math.round(a / 86400)}d`;
  return s >= 0 ? `${text} ago` : `in ${text}`;
}

// ---- Charts ----------------------------------------------------------------

// Rounds max/ticks up to 1, 2, 2.5 or 5 × 10^k so that `ticks` steps cover it.
function niceScale(max, ticks, floor) {
  const raw = Math.max(max, floor) / ticks;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw - 1e-12);
  return { step, max: step * ticks };
}

// Draws series [{label, color, values, right}] against `times` on a canvas:
// x is the last WINDOW_S seconds, y starts at 0; `stacked` fills areas;
// series with `right` use a second y axis labelled by `fmtRight`.
function drawChart(canvas, { times, series, stacked = false, fmt, fmtRight, floor = 1, floorRight = 1, message }) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const hasRight = series.some((s) => s.right);
  const pad = { l: 56, r: hasRight ? 50 : 14, t: 8, b: 22 };
  const pw = w - pad.l - pad.r;
  const ph = h - pad.t - pad.b;
  const now = state.prevAt || Date.now();
  const x = (t) => pad.l + pw * (1 - (now - t) / (WINDOW_S * 1000));

  // Stacking: each series is drawn from the running total below it.
  let drawn = series;
  if (stacked) {
    const acc = times.map(() => 0);
    drawn = series.map((s) => {
      const base = acc.slice();
      const values = s.values.map((v, i) => (acc[i] += v || 0));
      return { ...s, base, values };
    });
  }
  const maxOf = (list) => Math.max(0, ...list.flatMap((s) => s.values.filter((v) => v !== null && Number.isFinite(v))));
  const left = niceScale(maxOf(drawn.filter((s) => !s.right)), 4, floor);
  const right = niceScale(maxOf(drawn.filter((s) => s.right)), 4, floorRight);
  const y = (v, s) => pad.t + ph * (1 - v / s.max);

  // Grid and axes.
  ctx.font = '11px system-ui, sans-serif';
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const yy = Math.round(y(left.step * i, left)) + 0.5;
    ctx.strokeStyle = i === 0 ? '#b9c0c8' : '#eceff2';
    ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(pad.l + pw, yy); ctx.stroke();
    ctx.fillStyle = '#66717d';
    ctx.textAlign = 'right';
    ctx.fillText(fmt(left.step * i), pad.l - 6, yy + 4);
    if (hasRight) {
      ctx.textAlign = 'left';
      ctx.fillText(fmtRight(right.step * i), pad.l + pw + 6, yy + 4);
    }
  }
  ctx.textAlign = 'center';
  for (let m = 0; m * 60 <= WINDOW_S; m++) {
    const xx = Math.round(pad.l + pw * (1 - (m * 60) / WINDOW_S)) + 0.5;
    ctx.strokeStyle = '#f1f3f5';
    ctx.beginPath(); ctx.moveTo(xx, pad.t); ctx.lineTo(xx, pad.t + ph); ctx.stroke();
    ctx.fillText(m === 0 ? 'now' : `−${m} min`, Math.min(xx, pad.l + pw - 12), h - 6);
  }

  // Data, clipped to the plot area, broken at missing values and long gaps.
  ctx.save();
  ctx.beginPath(); ctx.rect(pad.l, pad.t, pw, ph); ctx.clip();
  for (const s of drawn) {
    const scale = s.right ? right : left;
    const runs = [];
    let run = null;
    s.values.forEach((v, i) => {
      const broken = v === null || !Number.isFinite(v) || (i > 0 && times[i] - times[i - 1] > GAP_MS);
      if (broken || !run) { run = []; runs.push(run); }
      if (v !== null && Number.isFinite(v)) run.push(i);
    });
    for (const r of runs.filter((r) => r.length)) {
      ctx.beginPath();
      r.forEach((i, k) => (k ? ctx.lineTo : ctx.moveTo).call(ctx, x(times[i]), y(s.values[i], scale)));
      ctx.strokeStyle = s.color;
      ctx.lineWidth = stacked ? 1 : 1.8;
      ctx.stroke();
      if (stacked) {
        for (const i of [...r].reverse()) ctx.lineTo(x(times[i]), y(s.base[i], scale));
        ctx.closePath();
        ctx.globalAlpha = 0.55;
        ctx.fillStyle = s.color;
        ctx.fill();
        ctx.globalAlpha = 1;
      } else if (r.length === 1) {
        ctx.fillStyle = s.color;
        ctx.fillRect(x(times[r[0]]) - 1.5, y(s.values[r[0]], scale) - 1.5, 3, 3);
      }
    }
  }
  ctx.restore();

  const text = message || (times.length ? '' : 'waiting for data…');
  if (text) {
    ctx.fillStyle = '#66717d';
    ctx.font = '13px system-ui, sans-serif';
    ctx.textAlign = 'center';
    ctx.fillText(text, pad.l + pw / 2, pad.t + ph / 2);
  }
}

// Draws chart `id` and its HTML legend (swatch, name, value). A chart of
// per-second rates (`opts.dts`: each point's seconds) shows each series'
// rate over the whole window, events ÷ seconds, so the legend agrees with
// the chart beside it; other charts show the latest value.
function chart(id, opts) {
  drawChart($(id), opts);
  const box = document.querySelector(`.legend[data-for="${id}"]`);
  const windowSecs = opts.dts ? opts.dts.reduce((a, dt) => a + dt, 0) : 0;
  const value = (s) => (opts.dts ? windowRate(s.values, opts.dts) : last(s.values));
  const spans = opts.series.map((s) => {
    const span = document.createElement('span');
    const swatch = document.createElement('i');
    swatch.style.background = s.color;
    span.dataset.series = s.label;
    span.append(swatch, `${s.label} ${(s.right ? opts.fmtRight : opts.fmt)(value(s))}`);
    return span;
  });
  if (opts.dts && windowSecs > 0) spans.push(cell('span', `over the last ${Math.round(windowSecs)} s`, 'window'));
  box.replaceChildren(...spans);
}

// The rate over a window of per-second `rates`, each held for `dts[i]`
// seconds: the events they stand for, divided by the window's seconds.
function windowRate(rates, dts) {
  let events = 0;
  let secs = 0;
  rates.forEach((r, i) => {
    if (r === null || !Number.isFinite(r)) return;
    events += r * dts[i];
    secs += dts[i];
  });
  return secs > 0 ? events / secs : null;
}

const last = (arr) => (arr.length ? arr[arr.length - 1] : null);

// Rebuilds every chart, legend and tile from state.points.
function render() {
  const pts = state.points;
  const times = pts.map((p) => p.t);
  const route = $('route-filter').value;
  const byPoint = pts.map((p) => outcomesOf(p, route));
  const recent = pts.slice(-SMOOTH_N);
  const recentOutcomes = sumOutcomes(byPoint.slice(-SMOOTH_N));
  const recentSecs = recent.reduce((a, p) => a + p.dt, 0);
  // Ratios over a short sliding window: one second alone is mostly noise.
  const windowed = (fn) => byPoint.map((_, i) => fn(sumOutcomes(byPoint.slice(Math.max(0, i - SMOOTH_N + 1), i + 1))));

  // Requests per second, stacked by outcome (outcomes that have appeared).
  const seen = new Set(byPoint.flatMap((o) => Object.keys(o)));
  const reqSeries = Object.entries(OUTCOMES).filter(([o]) => seen.has(o))
    .concat([...seen].filter((o) => !(o in OUTCOMES)).map((o) => [o, '#607d8b']))
    .map(([o, color]) => ({ label: o, color, values: byPoint.map((x, i) => (x[o] || 0) / pts[i].dt) }));
  const dts = pts.map((p) => p.dt);
  chart('chart-requests', { times, series: reqSeries, stacked: true, fmt: perSec, dts });

  const rates = [
    { label: 'replay rate (replayed ÷ executed+replayed)', color: '#1565c0', values: windowed(replayRate) },
    { label: 'duplicate rate (replayed+409+422 ÷ protected)', color: '#ef6c00', values: windowed(duplicateRate) },
  ];
  chart('chart-rates', { times, series: rates, fmt: pct, floor: 0.05 });

  const conflicts = [
    ['mismatch', 'mismatch (422)'], ['in_progress', 'in progress (409)'], ['outcome_unknown', 'outcome unknown'],
  ].map(([o, label]) => ({ label, color: OUTCOMES[o], values: byPoint.map((x, i) => (x[o] || 0) / pts[i].dt) }));
  chart('chart-conflicts', { times, series: conflicts, fmt: perSec, dts });

  const toMs = (q) => pts.map((p) => { const v = quantile(q, p.buckets); return v === null ? null : v * 1000; });
  const latency = [
    { label: 'p50', color: '#1565c0', values: toMs(0.5) },
    { label: 'p99', color: '#c62828', values: toMs(0.99) },
  ];
  chart('chart-store-latency', { times, series: latency, fmt: ms, floor: 1 });

  const records = [
    { label: 'processing', color: '#1565c0', values: pts.map((p) => p.processing) },
    { label: 'stuck', color: '#c62828', values: pts.map((p) => p.stuck) },
  ];
  chart('chart-records', { times, series: records, fmt: num, floor: 4 });

  const outbox = [
    { label: 'pending rows', color: '#6a1b9a', values: pts.map((p) => p.outboxPending) },
    { label: 'lag', color: '#00897b', values: pts.map((p) => p.outboxLag), right: true },
  ];
  const relay = state.prev && (state.prev.list('idem_outbox_pending').length || state.prev.list('idem_outbox_lag_seconds').length);
  chart('chart-outbox', {
    times, series: outbox, fmt: num, fmtRight: secs, floor: 4,
    message: state.prev && !relay ? 'no relay reporting' : '',
  });

  // Tiles.
  const p99 = quantile(0.99, mergeBuckets(recent.map((p) => p.buckets)));
  const lastPoint = last(pts);
  const recentAll = Object.values(recentOutcomes).reduce((a, v) => a + v, 0);
  $('tile-rps').textContent = recentSecs > 0 ? num(recentAll / recentSecs) : '–';
  $('tile-replay').textContent = pct(replayRate(recentOutcomes));
  $('tile-p99').textContent = p99 === null ? '–' : ms(p99 * 1000);
  $('tile-processing').textContent = lastPoint ? num(lastPoint.processing) : '–';
  $('tile-stuck').textContent = lastPoint ? num(lastPoint.stuck) : '–';
  $('tile-stuck').classList.toggle('bad', Boolean(lastPoint && lastPoint.stuck > 0));
  const reruns = state.prev ? total(state.prev, 'idem_reruns_total') : null;
  $('tile-reruns').textContent = reruns === null ? '–' : num(reruns);
  $('tile-reruns').classList.toggle('bad', Boolean(reruns));
  if (state.prev) {
    const settled = (r) => total(state.prev, 'idem_reconciled_total', (l) => l.result === r);
    const gaveUp = settled('gave_up');
    $('tile-reconciled').textContent = `${num(settled('completed'))} / ${num(settled('released'))}${gaveUp ? ` · ${num(gaveUp)} gave up` : ''}`;
    $('tile-reconciled').classList.toggle('bad', gaveUp > 0);
  }
  $('tile-version').textContent = state.version || '–';

  // Since start: the counters' own values, so that a dashboard opened
  // after the traffic still shows it.
  if (state.prev) {
    const since = sumOutcomes(state.prev.list('idem_requests_total')
      .filter((s) => !route || s.labels.route === route)
      .map((s) => ({ [s.labels.outcome || '?']: s.value })));
    $('total-requests').textContent = count(Object.values(since).reduce((a, v) => a + v, 0));
    $('total-executed').textContent = count(since.executed || 0);
    $('total-replayed').textContent = count(since.replayed || 0);
    $('total-conflicts').textContent = count(sum(since, ['in_progress', 'mismatch']));
    $('total-held').textContent = count(since.outcome_unknown || 0);
    $('total-held').classList.toggle('bad', Boolean(since.outcome_unknown));
    renderWebhooks(state.prev.list('idem_webhook_deliveries_total'));
  }
}

// Webhook deliveries since start, one row per provider and route: verified,
// refused, and the most common reason for refusing. Hidden when no route
// receives webhooks.
function renderWebhooks(series) {
  $('webhooks').hidden = series.length === 0;
  if (series.length === 0) return;
  const rows = new Map();
  for (const s of series) {
    const { provider = '?', route = '?', result = '?' } = s.labels;
    const id = `${provider} ${route}`;
    const row = rows.get(id) || { provider, route, verified: 0, refused: 0, reasons: {} };
    if (result === 'verified') row.verified += s.value;
    else {
      row.refused += s.value;
      row.reasons[result] = (row.reasons[result] || 0) + s.value;
    }
    rows.set(id, row);
  }
  const table = document.createElement('table');
  const head = document.createElement('tr');
  for (const h of ['provider', 'route', 'verified', 'refused', 'most refused for']) head.append(cell('th', h));
  table.append(head);
  for (const r of [...rows.values()].sort((a, b) => a.provider.localeCompare(b.provider) || a.route.localeCompare(b.route))) {
    const top = Object.entries(r.reasons).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1])[0];
    const tr = document.createElement('tr');
    tr.dataset.provider = r.provider;
    tr.append(cell('td', r.provider), cell('td', r.route), cell('td', count(r.verified)),
      cell('td', count(r.refused), r.refused > 0 ? 'bad' : ''), cell('td', top ? top[0] : '–'));
    table.append(tr);
  }
  $('webhook-list').replaceChildren(table);
}

// ---- Records ---------------------------------------------------------------

function cell(tag, content, className) {
  const el = document.createElement(tag);
  if (content instanceof Node) el.append(content); else el.textContent = content ?? '';
  if (className) el.className = className;
  return el;
}

function note(text, className = 'note') { return cell('p', text, className); }

// A two-column table of [label, value] rows.
function fieldTable(rows) {
  const table = document.createElement('table');
  for (const [label, value, className] of rows) {
    const tr = document.createElement('tr');
    tr.append(cell('th', label), cell('td', value, className));
    table.append(tr);
  }
  return table;
}

const when = (iso) => (iso ? `${iso} (${ago(iso)})` : '–');

function renderRecord(r) {
  const resp = r.response;
  const rows = [
    ['state', r.state, `state-${r.state}`],
    ['outcome unknown', r.outcome_unknown ? 'YES: reconcile before releasing' : 'no', r.outcome_unknown ? 'flag' : ''],
    ['tenant', r.tenant], ['operation', r.operation], ['key', r.key],
    ['fingerprint', r.fingerprint], ['attempt', String(r.attempt)],
    ['created', when(r.created_at)], ['updated', when(r.updated_at)],
    ['expires', when(r.expires_at)], ['lease until', when(r.locked_until)],
    ['resource id', r.resource_id ?? '–'], ['error code', r.error_code ?? '–'],
  ];
  if (!resp) {
    rows.push(['response', 'none (still processing)']);
  } else {
    rows.push(['response status', String(resp.status)]);
    const headers = Object.entries(resp.headers || {}).map(([k, v]) => `${k}: ${v}`).join('\n');
    rows.push(['response headers', cell('pre', headers || '–')]);
    rows.push(['body bytes', String(resp.body_bytes ?? '–')]);
    if ('body' in resp) rows.push(['body', cell('pre', resp.body)]);
    if ('body_hex' in resp) rows.push(['body (hex)', cell('pre', resp.body_hex)]);
  }
  return fieldTable(rows);
}

let inspectSeq = 0; // only the latest lookup may draw its answer

async function inspect() {
  const seq = ++inspectSeq;
  const out = $('inspect-result');
  const show = (node) => { if (seq === inspectSeq) out.replaceChildren(node); };
  const parts = ['inspect-tenant', 'inspect-operation', 'inspect-key'].map((id) => $(id).value.trim());
  if (parts.some((p) => !p)) { show(note('tenant, operation and key are all needed')); return; }
  const path = `/api/v1/records/${parts.map(encodeURIComponent).join('/')}${$('inspect-body').checked ? '?body=true' : ''}`;
  show(note('loading…'));
  try {
    const resp = await api(path);
    if (resp.status === 404) show(note('no such record'));
    else if (!resp.ok) show(note(await problemText(resp), 'error-text'));
    else show(renderRecord(await resp.json()));
  } catch (err) {
    show(note(err instanceof AuthError ? 'token required' : err.message, 'error-text'));
  }
}

$('inspect-form').addEventListener('submit', (ev) => { ev.preventDefault(); inspect(); });

async function pollProcessing() {
  if (awaitingToken) return;
  const box = $('processing-list');
  const resp = await api('/api/v1/records?state=processing&limit=20');
  if (!resp.ok) { box.replaceChildren(note(await problemText(resp), 'error-text')); return; }
  const { records = [], next = null } = await resp.json();
  if (!records.length) { box.replaceChildren(note('no records in processing')); return; }
  const table = document.createElement('table');
  const head = document.createElement('tr');
  for (const h of ['tenant', 'operation', 'key', 'age', 'attempt', 'outcome unknown']) head.append(cell('th', h));
  table.append(cell('thead', head));
  const body = document.createElement('tbody');
  for (const r of records) {
    const tr = document.createElement('tr');
    const tenant = cell('td', r.tenant.length > 14 ? `${r.tenant.slice(0, 12)}…` : r.tenant);
    tenant.title = r.tenant;
    tr.append(tenant, cell('td', r.operation), cell('td', r.key), cell('td', ago(r.created_at).replace(' ago', '')),
      cell('td', String(r.attempt)), cell('td', r.outcome_unknown ? 'yes' : '', r.outcome_unknown ? 'flag' : ''));
    tr.title = 'inspect this record';
    tr.addEventListener('click', () => {
      $('inspect-tenant').value = r.tenant;
      $('inspect-operation').value = r.operation;
      $('inspect-key').value = r.key;
      inspect();
    });
    body.append(tr);
  }
  table.append(body);
  box.replaceChildren(table);
  if (next) box.append(note('more processing records exist: idem records list --state processing'));
}

function pollProcessingSafely() {
  return pollProcessing().catch((err) => {
    const text = err instanceof AuthError ? 'token required' : err.message;
    $('processing-list').replaceChildren(note(text, 'error-text'));
  });
}

// ---- Start -----------------------------------------------------------------

// Runs fn every `period` ms, never two at once, whatever fn throws.
function every(period, fn) {
  const tick = async () => {
    try { await fn(); } catch (err) { console.error(err); }
    setTimeout(tick, period);
  };
  tick();
}

takeTokenFromHash();
$('route-filter').addEventListener('change', render);
window.addEventListener('resize', render);
every(POLL_MS, () => pollMetrics().catch((err) => {
  if (err instanceof AuthError) return;
  setStatus(`error: ${err instanceof TypeError ? 'admin listener unreachable' : err.message}`, 'error');
}));
every(RECORDS_POLL_MS, pollProcessingSafely);
render();
