//! Listing for operators: filters, pages without gaps or repeats, and
//! the bound on a page.

use super::*;

/// Listing filters by tenant, state and age, pages without gaps or
/// repeats, and reports records oldest first.
pub async fn list_filters_and_pages<S: Store + ListRecords>(store: Arc<S>) {
    let scope = unique_scope("list");
    let mut all = Vec::new();
    for i in 0..5 {
        let k = key(&format!("list-{i}"));
        let lease = acquire(
            &*store,
            request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
        )
        .await;
        if i < 3 {
            store
                .resolve(&scope, &k, &lease, &outcome(Verdict::Completed, "l", DAY))
                .await
                .expect("resolve");
        }
        all.push(k);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let tenant = Some(scope.tenant().to_owned());
    let mut seen = Vec::new();
    let mut after: Option<Cursor> = None;
    let mut pages = 0;
    loop {
        let page = store
            .list(&ListFilter {
                tenant: tenant.clone(),
                limit: 2,
                after: after.clone(),
                ..ListFilter::default()
            })
            .await
            .expect("list");
        assert!(page.records.len() <= 2);
        seen.extend(page.records.iter().map(|r| r.key.clone()));
        pages += 1;
        assert!(pages < 10, "paging does not end");
        match page.next {
            Some(c) => after = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, all, "every record once, oldest first");

    let processing = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            state: Some(RecordState::Processing),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(processing.records.len(), 2);
    assert!(
        processing
            .records
            .iter()
            .all(|r| r.state == RecordState::Processing)
    );
    assert!(processing.next.is_none());

    let old = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            older_than: Some(Duration::from_secs(3600)),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert!(old.records.is_empty());
    tokio::time::sleep(Duration::from_millis(30)).await;
    let recent = store
        .list(&ListFilter {
            tenant,
            older_than: Some(Duration::from_millis(20)),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(recent.records.len(), 5);
}

/// One list call returns at most [`MAX_PAGE`] records, whatever limit it
/// asks for, and a cursor to the rest; a limit of 0 reads as 1.
pub async fn list_pages_are_bounded<S: Store + ListRecords>(store: Arc<S>) {
    let scope = unique_scope("list-bound");
    let mut tasks = JoinSet::new();
    for worker in 0..8 {
        let (store, scope) = (store.clone(), scope.clone());
        tasks.spawn(async move {
            for i in (worker..=MAX_PAGE).step_by(8) {
                let k = key(&format!("bound-{i}"));
                acquire(
                    &*store,
                    request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
                )
                .await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("reserve task");
    }
    let tenant = Some(scope.tenant().to_owned());
    let first = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            limit: usize::MAX,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(first.records.len(), MAX_PAGE, "a page is capped");
    let rest = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            limit: usize::MAX,
            after: Some(first.next.expect("a cursor to the rest")),
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(rest.records.len(), 1, "the record past the cap");
    assert!(rest.next.is_none());
    let one = store
        .list(&ListFilter {
            tenant,
            limit: 0,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(one.records.len(), 1, "a limit of 0 reads as 1");
}
