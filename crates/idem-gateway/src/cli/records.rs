//! `idem records …` and `idem cleanup`: the admin API's record actions,
//! run against the store directly (no gateway needed). They share
//! [`idem::operator`] with the admin API, so both behave the same.

use std::io::Write;
use std::time::Duration;

use idem::operator;
use idem::seal::Sealed;
use idem::store::MAX_PAGE;
use idem::{DynStore, IdempotencyKey, ListRecords, Purge, RecordState, Scope, Store, Timestamp};

use crate::error::GatewayError;
use crate::records::{RecordView, ResolveRequest, encode_cursor};
use crate::store::StoreUrl;

/// The store URL argument every operator command takes.
#[derive(Debug, clap::Args)]
pub(super) struct StoreArg {
    /// Store URL.
    #[arg(long, env = "IDEM_STORE", default_value = crate::config::DEFAULT_STORE)]
    pub(super) store: String,
}

/// `idem records …`.
#[derive(Debug, clap::Subcommand)]
pub(super) enum RecordsCommand {
    /// List records, oldest first.
    List {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        filter: ListArgs,
    },
    /// Show one record (as JSON).
    Show {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: RecordId,
        /// Include the stored response body.
        #[arg(long)]
        body: bool,
    },
    /// Free a processing record's key (its work is known not to have happened).
    Release {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: RecordId,
        #[command(flatten)]
        guard: AttemptArg,
    },
    /// Record the final answer of a processing record (reconcile an outcome_unknown one).
    Resolve {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: RecordId,
        #[command(flatten)]
        guard: AttemptArg,
        #[command(flatten)]
        answer: ResolveArgs,
    },
    /// Delete one record, whatever its state.
    Purge {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: RecordId,
    },
}

/// Runs an `idem records` command against the store it names.
pub(super) async fn run(command: RecordsCommand) -> Result<(), GatewayError> {
    match command {
        RecordsCommand::List { store, filter } => list(&open(&store.store).await?, &filter).await,
        RecordsCommand::Show { store, id, body } => {
            show(&open(&store.store).await?, &id, body).await
        }
        RecordsCommand::Release { store, id, guard } => {
            release(&open(&store.store).await?, &id, guard.attempt).await
        }
        RecordsCommand::Resolve {
            store,
            id,
            guard,
            answer,
        } => resolve(&open(&store.store).await?, &id, guard.attempt, &answer).await,
        RecordsCommand::Purge { store, id } => purge(&open(&store.store).await?, &id).await,
    }
}

/// Opens a store for a one-off command: unreachable is an error at once,
/// and nothing is created or migrated (a mistyped SQLite path is an error,
/// not a new empty database; a PostgreSQL schema is left for
/// `idem migrate`).
///
/// With `IDEM_ENCRYPTION_KEYS` set, bodies sealed at rest read as clear
/// text (and a resolved record is sealed), as through the gateway.
pub(super) async fn open(url: &str) -> Result<DynStore, GatewayError> {
    let store = StoreUrl::parse(url)?.existing()?.connect().await?;
    match crate::config::env_seal_keys()? {
        Some(keys) => Ok(DynStore::new(Sealed::new(store, keys))),
        None => Ok(store),
    }
}

/// Which record a command acts on: the three words of a row's ID column in
/// `idem records list`, pasted as they are.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct RecordId {
    /// Tenant, as `idem records list` shows it (for
    /// `from = "authorization"`, the keyed hash of the Authorization value,
    /// never the value itself).
    pub tenant: String,
    /// Operation, e.g. "POST /v1/payments".
    pub operation: String,
    /// The Idempotency-Key.
    pub key: String,
}

/// The fence of the commands that change a processing record.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct AttemptArg {
    /// Act only if the record is still at this attempt (the one you
    /// looked at with `show`); another attempt that took over since is
    /// left alone.
    #[arg(long)]
    pub attempt: Option<u32>,
}

impl RecordId {
    fn parse(&self) -> Result<(Scope, IdempotencyKey), GatewayError> {
        let scope = Scope::new(&self.tenant, &self.operation)
            .map_err(|e| GatewayError::Invalid(format!("tenant/operation: {e}")))?;
        let key = self
            .key
            .parse()
            .map_err(|e| GatewayError::Invalid(format!("key: {e}")))?;
        Ok((scope, key))
    }
}

/// `idem records list` filters.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct ListArgs {
    /// Only records in this state: processing, completed or failed; or
    /// `held` (processing, outcome unknown or lease lapsed: waiting for a
    /// reconciler or an operator), or `rerun` (run more than once: attempt
    /// 2 or more, any state).
    #[arg(long)]
    pub state: Option<ListState>,
    /// Only records created at least this long ago (e.g. 60s, 2h).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub older_than: Option<Duration>,
    /// Only this tenant's records.
    #[arg(long)]
    pub tenant: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub limit: u32,
    /// Print JSON (the admin API's record format), one page object.
    #[arg(long)]
    pub json: bool,
}

/// What `idem records list --state` selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ListState {
    /// One stored state.
    Is(RecordState),
    /// Processing with nobody running it: outcome unknown, or lease lapsed.
    Held,
    /// Taken over at least once: the work may have run more than once.
    Rerun,
}

impl std::str::FromStr for ListState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "held" => Ok(Self::Held),
            "rerun" => Ok(Self::Rerun),
            other => other.parse().map(Self::Is).map_err(|_| {
                format!("{other:?}: expected processing, completed, failed, held or rerun")
            }),
        }
    }
}

impl ListState {
    /// The state the store can filter on.
    fn stored(self) -> Option<RecordState> {
        match self {
            Self::Is(state) => Some(state),
            Self::Held => Some(RecordState::Processing),
            Self::Rerun => None,
        }
    }

    /// Whether `record` is selected (after the store's filter).
    fn selects(self, record: &idem::Record, now: Timestamp) -> bool {
        match self {
            Self::Is(_) => true,
            Self::Held => record.is_outcome_unknown() || !record.lease_live(now),
            Self::Rerun => record.lease.attempt > 1,
        }
    }
}

/// `idem records resolve` answer.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct ResolveArgs {
    /// The HTTP status to replay.
    #[arg(long)]
    pub status: u16,
    /// A header to replay, `name: value` (repeatable).
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// The body to replay, or @FILE to read it from a file.
    #[arg(long, default_value = "")]
    pub body: String,
    /// Record a deterministic failure (default: completed below 400, failed from 400).
    #[arg(long)]
    pub failed: bool,
    /// What the operation created.
    #[arg(long)]
    pub resource_id: Option<String>,
    /// Machine-readable reason.
    #[arg(long)]
    pub error_code: Option<String>,
    /// How long to keep the answer.
    #[arg(long, default_value = "24h")]
    pub retention: String,
}

impl ResolveArgs {
    fn request(&self) -> Result<ResolveRequest, GatewayError> {
        let bytes = match self.body.strip_prefix('@') {
            Some(path) => std::fs::read(path)
                .map_err(|e| GatewayError::io(format!("--body @{path}: cannot read it"), e))?,
            None => self.body.clone().into_bytes(),
        };
        // Text stays text; other bytes travel hex-encoded.
        let (body, body_hex) = match String::from_utf8(bytes) {
            Ok(text) => (Some(text), None),
            Err(e) => (None, Some(idem::fingerprint::to_hex(e.as_bytes()))),
        };
        let headers = self
            .headers
            .iter()
            .map(|h| {
                h.split_once(':')
                    .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
                    .ok_or_else(|| {
                        GatewayError::Invalid(format!("--header {h:?}: expected `name: value`"))
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(ResolveRequest {
            verdict: self.failed.then(|| "failed".to_owned()),
            status: self.status,
            headers,
            body,
            body_hex,
            resource_id: self.resource_id.clone(),
            error_code: self.error_code.clone(),
            retention: Some(self.retention.clone()),
        })
    }
}

/// `idem records list`.
async fn list(store: &DynStore, args: &ListArgs) -> Result<(), GatewayError> {
    let mut filter = idem::ListFilter {
        state: args.state.and_then(ListState::stored),
        older_than: args.older_than,
        tenant: args.tenant.clone(),
        limit: 0,
        after: None,
    };
    let wanted = args.limit as usize;
    let mut records = Vec::new();
    let mut next = None;
    while records.len() < wanted {
        filter.limit = (wanted - records.len()).min(MAX_PAGE);
        let page = store.list(&filter).await?;
        let now = Timestamp::now();
        records.extend(
            page.records
                .into_iter()
                .filter(|r| args.state.is_none_or(|s| s.selects(r, now))),
        );
        next = page.next;
        match &next {
            Some(cursor) => filter.after = Some(cursor.clone()),
            None => break,
        }
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let page = serde_json::json!({
            "records": records.iter().map(|r| RecordView::new(r, false)).collect::<Vec<_>>(),
            "next": next.as_ref().map(encode_cursor),
        });
        writeln!(out, "{page:#}")
            .map_err(|e| GatewayError::io("cannot write to standard output", e))?;
        return Ok(());
    }
    let now = Timestamp::now();
    let write = |out: &mut std::io::StdoutLock<'_>, line: std::fmt::Arguments<'_>| {
        writeln!(out, "{line}").map_err(|e| GatewayError::io("cannot write to standard output", e))
    };
    // The ID column last and whole: pasted after `idem records show`
    // (or release, resolve, purge), it names the row's record.
    write(
        &mut out,
        format_args!(
            "{:<10} {:>5} {:>7}  {:<15}  ID (tenant operation key)",
            "STATE", "AGE", "ATTEMPT", "NOTE"
        ),
    )?;
    for r in &records {
        let note = if r.is_outcome_unknown() {
            "outcome unknown"
        } else if r.state == RecordState::Processing && !r.lease_live(now) {
            "lease lapsed"
        } else {
            ""
        };
        write(
            &mut out,
            format_args!(
                "{:<10} {:>5} {:>7}  {note:<15}  {}",
                r.state.as_str(),
                age(now.since(r.created_at)),
                r.lease.attempt,
                record_id_words(r.scope.tenant(), r.scope.operation(), r.key.as_str()),
            ),
        )?;
    }
    let more = if next.is_some() {
        " (more: raise --limit)"
    } else {
        ""
    };
    write(&mut out, format_args!("{} record(s){more}", records.len()))
}

/// A record's id as shell words, quoted where the shell would split or
/// expand them, behind `--` when a word starts with `-` (so that it is not
/// read as a flag).
fn record_id_words(tenant: &str, operation: &str, key: &str) -> String {
    let words = [tenant, operation, key];
    let quoted = words.map(shell_word).join(" ");
    if words.iter().any(|w| w.starts_with('-')) {
        format!("-- {quoted}")
    } else {
        quoted
    }
}

/// One word for a POSIX shell: as it is when it holds only characters no
/// shell treats specially, else in single quotes (a `'` inside written
/// `'\''`).
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.,:/@%+=".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// `idem records show`.
async fn show(store: &DynStore, id: &RecordId, body: bool) -> Result<(), GatewayError> {
    let (scope, key) = id.parse()?;
    match store.get(&scope, &key).await? {
        Some(record) => {
            println!("{:#}", serde_json::json!(RecordView::new(&record, body)));
            Ok(())
        }
        None => Err(operator::OperatorError::NotFound.into()),
    }
}

/// `idem records release`.
async fn release(
    store: &DynStore,
    id: &RecordId,
    attempt: Option<u32>,
) -> Result<(), GatewayError> {
    let (scope, key) = id.parse()?;
    let record = operator::release(store, &scope, &key, attempt).await?;
    println!(
        "idem: released {scope} {key} (was attempt {}{}); the next request with this key runs again",
        record.lease.attempt,
        if record.is_outcome_unknown() {
            ", outcome unknown"
        } else {
            ""
        }
    );
    Ok(())
}

/// `idem records resolve`.
async fn resolve(
    store: &DynStore,
    id: &RecordId,
    attempt: Option<u32>,
    args: &ResolveArgs,
) -> Result<(), GatewayError> {
    let (scope, key) = id.parse()?;
    let outcome = args.request()?.outcome(Duration::from_secs(86_400))?;
    let record = operator::resolve(store, &scope, &key, &outcome, attempt).await?;
    println!(
        "idem: resolved {scope} {key} as {} {}; retries now get this answer",
        record.state, outcome.response.status
    );
    Ok(())
}

/// `idem records purge`: deletes one record whatever its state.
async fn purge(store: &DynStore, id: &RecordId) -> Result<(), GatewayError> {
    let (scope, key) = id.parse()?;
    if store.delete(&scope, &key).await? {
        println!("idem: deleted {scope} {key}");
        Ok(())
    } else {
        Err(operator::OperatorError::NotFound.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_ids_paste_back_as_the_same_three_words() {
        assert_eq!(
            record_id_words("t1", "POST /v1/payments", "k-1"),
            "t1 'POST /v1/payments' k-1"
        );
        assert_eq!(
            record_id_words("t1", "POST /v1/x", "-k"),
            "-- t1 'POST /v1/x' -k"
        );
        assert_eq!(shell_word("it's $HOME"), r"'it'\''s $HOME'");
        assert_eq!(shell_word("a*b"), "'a*b'");
    }
}
