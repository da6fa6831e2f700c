// The operations page's script: a refresh of the consumer tables (server-rendered HTML), on
// every event of the live feed and otherwise periodically, and the live feed of the event
// stream. Event data is only ever set as text.
(function () {
  'use strict';
  var body = document.body;
  var consumers = document.getElementById('consumers');
  var refreshEvery = parseInt(body.dataset.refresh, 10) || 5000;

  // A form being filled in (or a retire confirmation open) is not replaced under the
  // operator's fingers.
  function busy() {
    if (consumers.querySelector('details[open]')) { return true; }
    var inputs = consumers.querySelectorAll('form input:not([type=hidden])');
    for (var i = 0; i < inputs.length; i++) {
      if (inputs[i].value !== '' || inputs[i] === document.activeElement) { return true; }
    }
    return false;
  }

  // The tables used to reload only every 5 s, so they trailed the feed by up to that: now
  // each event of the feed asks for a reload too, at most one a second (minGap) and one at a
  // time, so that a burst of deletions costs the database one status read a second, not
  // one per event. One more reload follows a second after the last, for the consumers that
  // acknowledge an event a little after the stream shows it.
  var minGap = 1000, last = 0, inflight = false, timer = null, again = false;
  function soon() {
    again = true;
    if (timer || inflight) { return; }
    timer = setTimeout(function () { timer = null; again = false; refresh(); }, Math.max(0, last + minGap - Date.now()));
  }
  function refresh() {
    if (busy() || inflight) { return; }
    inflight = true;
    last = Date.now();
    fetch('consumers', { credentials: 'same-origin' }).then(function (r) {
      if (!r.ok) { throw new Error('status ' + r.status); }
      return r.text();
    }).then(function (html) {
      if (busy()) { return; }
      consumers.innerHTML = html; // rendered and escaped by the server
      var t = document.getElementById('refreshed');
      if (t) { t.textContent = new Date().toISOString().slice(11, 19) + 'Z'; }
    }).catch(function () { /* the next refresh tries again */ }).then(function () {
      inflight = false;
      if (again) { soon(); } else if (followUp) { followUp = false; soon(); }
    });
  }
  var followUp = false;
  setInterval(refresh, refreshEvery);

  var url = body.dataset.events;
  if (!url || !window.EventSource) { return; }
  var feed = { events: 0, duplicates: 0, gaps: 0, resets: 0, reconnects: 0, last: {} };
  window.outboxFeed = feed;
  var rows = document.getElementById('feed-rows');
  var state = document.getElementById('feed-state');
  var note = document.getElementById('feed-note');
  function show(id, v) { document.getElementById(id).textContent = String(v); }
  function setState(text, cls) { state.textContent = text; state.className = 'state ' + cls; }
  function cell(tr, text) { var td = document.createElement('td'); td.textContent = text; tr.appendChild(td); }

  var opened = 0;
  var es = new EventSource(url);
  es.onopen = function () {
    if (opened++ > 0) { feed.reconnects++; show('feed-reconnects', feed.reconnects); }
    setState('live', 'live');
  };
  es.onerror = function () {
    setState(es.readyState === EventSource.CLOSED ? 'closed' : 'reconnecting…', 'down');
  };
  es.addEventListener('task:deleted', function (m) {
    var ev = JSON.parse(m.data);
    var last = feed.last[ev.projectId];
    if (last !== undefined) {
      if (ev.sequence <= last) { feed.duplicates++; } else if (ev.sequence > last + 1) { feed.gaps += ev.sequence - last - 1; }
    }
    if (last === undefined || ev.sequence > last) { feed.last[ev.projectId] = ev.sequence; }
    feed.events++;
    show('feed-count', feed.events); show('feed-dups', feed.duplicates); show('feed-gaps', feed.gaps);
    var tr = document.createElement('tr');
    tr.className = 'fresh';
    [ev.projectId, String(ev.sequence), ev.taskId, ev.deletedAt, ev.priorColumn || '', ev.writerProcessId].forEach(function (t) { cell(tr, t); });
    rows.insertBefore(tr, rows.firstChild);
    setTimeout(function () { tr.className = ''; }, 1500);
    while (rows.children.length > 30) { rows.removeChild(rows.lastChild); }
    followUp = true;
    soon();
  });
  es.addEventListener('reset', function (m) {
    var r = JSON.parse(m.data);
    feed.resets++;
    show('feed-resets', feed.resets);
    r.projects.forEach(function (p) { delete feed.last[p]; });
    note.textContent = 'The stream was reset for ' + r.projects.join(', ') + ' (' + r.reason + '): the tables were refetched.';
    note.hidden = false;
    refresh();
  });
})();
