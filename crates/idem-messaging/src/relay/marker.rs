//! Acknowledged rows marked published in the background, one statement
//! for whatever piled up, so that publishing never waits for it.

use idem_postgres::outbox::{AggregateKey, Outbox};
use idem_postgres::sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Marks acknowledged rows published in the background, one statement
/// ([`Outbox::mark_published`]) for whatever piled up meanwhile, so publishing never waits for it. Until
/// they are marked, an aggregate's acknowledged rows (always the first of
/// its pending rows) count as gone: reads start after the highest
/// acknowledged sequence of each aggregate.
pub(super) struct Marker {
    tx: tokio::sync::mpsc::UnboundedSender<Vec<(i64, AggregateKey, i64)>>,
    through: Arc<Mutex<HashMap<AggregateKey, i64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Marker {
    pub(super) fn start(pool: PgPool) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<(i64, AggregateKey, i64)>>();
        let through = Arc::new(Mutex::new(HashMap::new()));
        let shared = Arc::clone(&through);
        let task = tokio::spawn(async move {
            while let Some(mut rows) = rx.recv().await {
                while let Ok(more) = rx.try_recv() {
                    rows.extend(more);
                }
                let ids: Vec<i64> = rows.iter().map(|(id, _, _)| *id).collect();
                let mut tries = 0;
                loop {
                    tries += 1;
                    match Outbox::mark_published(&pool, &ids).await {
                        Ok(_) => break,
                        Err(err) if tries >= 3 => {
                            // Left pending: read again and re-published
                            // with the same ids, which the broker drops.
                            tracing::warn!(reason = "relay_mark_failed", rows = ids.len(), %err, "acknowledged rows stay pending and will be published again");
                            break;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(100 * tries)).await,
                    }
                }
                let mut map = shared.lock().unwrap_or_else(|p| p.into_inner());
                for (_, key, sequence) in rows {
                    // Unless a later mark of the aggregate is still on
                    // its way, reads see the table again.
                    if map.get(&key) == Some(&sequence) {
                        map.remove(&key);
                    }
                }
            }
        });
        Self { tx, through, task }
    }

    /// Per aggregate, the highest sequence acknowledged and not yet marked.
    pub(super) fn through(&self) -> HashMap<AggregateKey, i64> {
        self.through
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(super) fn mark(&self, rows: Vec<(i64, AggregateKey, i64)>) {
        {
            let mut map = self.through.lock().unwrap_or_else(|p| p.into_inner());
            for (_, key, sequence) in &rows {
                let entry = map.entry(key.clone()).or_insert(*sequence);
                *entry = (*entry).max(*sequence);
            }
        }
        let _ = self.tx.send(rows);
    }

    /// Marks what is left, then stops.
    pub(super) async fn finish(self) {
        drop(self.tx);
        let _ = self.task.await;
    }
}
