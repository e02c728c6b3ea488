//! The Responses API's store: the responses this instance made, oldest first out.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// A stored response and the conversation a follow-up continues.
#[derive(Debug, Clone)]
pub(super) struct Stored {
    pub(super) response: Value,
    /// Chat messages: the request's input turns (with their system message) and the output.
    pub(super) conversation: Vec<Value>,
}

/// The responses this instance stores, oldest first out.
#[derive(Debug)]
pub(crate) struct ResponseStore {
    capacity: usize,
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
    /// The background responses running, by id: cancelling one aborts its task.
    running: Mutex<HashMap<String, tokio::task::AbortHandle>>,
}

impl ResponseStore {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
            running: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<String, Stored>, VecDeque<String>)> {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub(super) fn insert(&self, id: String, stored: Stored) {
        let mut guard = self.lock();
        self.insert_locked(&mut guard, id, stored);
    }

    /// Inserts, then forgets the oldest finished responses past the capacity (one still
    /// running stays: its task will store it again, and a cancel must find it).
    fn insert_locked(
        &self,
        guard: &mut (HashMap<String, Stored>, VecDeque<String>),
        id: String,
        stored: Stored,
    ) {
        let (map, order) = guard;
        if map.insert(id.clone(), stored).is_none() {
            order.push_back(id);
        }
        // The newest (just inserted) stays.
        let mut index = 0;
        while map.len() > self.capacity && index + 1 < order.len() {
            let running = map
                .get(&order[index])
                .is_some_and(|kept| unfinished(&kept.response));
            if running {
                index += 1;
                continue;
            }
            if let Some(oldest) = order.remove(index) {
                map.remove(&oldest);
            }
        }
    }

    pub(super) fn get(&self, id: &str) -> Option<Stored> {
        self.lock().0.get(id).cloned()
    }

    /// Stores the finished `stored` unless its response was cancelled meanwhile (vLLM keeps a
    /// cancelled response as it was cancelled), under one lock with the check.
    pub(super) fn finish(&self, id: String, stored: Stored) {
        let mut guard = self.lock();
        if guard
            .0
            .get(&id)
            .is_some_and(|kept| kept.response["status"] == "cancelled")
        {
            return;
        }
        self.insert_locked(&mut guard, id, stored);
    }

    /// Whether a response is stored cancelled.
    pub(super) fn cancelled(&self, id: &str) -> bool {
        self.lock()
            .0
            .get(id)
            .is_some_and(|kept| kept.response["status"] == "cancelled")
    }

    /// Marks a response still queued or in progress cancelled, and gives it; `Ok(None)` if it
    /// is finished (only a background response can be cancelled); `Err` if unknown.
    pub(super) fn cancel(&self, id: &str) -> Result<Option<Value>, ()> {
        let mut guard = self.lock();
        let stored = guard.0.get_mut(id).ok_or(())?;
        if !unfinished(&stored.response) {
            return Ok(None);
        }
        stored.response["status"] = Value::from("cancelled");
        Ok(Some(stored.response.clone()))
    }

    /// Notes a background response's task, until [`Self::stopped`].
    pub(super) fn running(&self, id: String, task: tokio::task::AbortHandle) {
        self.running
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(id, task);
    }

    /// A background response's task ended (or is to end): forgets it, and gives its handle.
    pub(super) fn stopped(&self, id: &str) -> Option<tokio::task::AbortHandle> {
        self.running
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .remove(id)
    }

    /// Responses stored now.
    pub(crate) fn len(&self) -> usize {
        self.lock().0.len()
    }
}

/// A response still queued or in progress (a background one running).
fn unfinished(response: &Value) -> bool {
    matches!(response["status"].as_str(), Some("queued" | "in_progress"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_store_is_bounded_oldest_first() {
        let store = ResponseStore::new(2);
        for id in ["a", "b", "c"] {
            store.insert(
                id.to_owned(),
                Stored {
                    response: json!({}),
                    conversation: Vec::new(),
                },
            );
        }
        assert_eq!(store.len(), 2);
        assert!(store.get("a").is_none());
        assert!(store.get("c").is_some());
        assert_eq!(
            store.cancel("b"),
            Ok(None),
            "a finished response is not cancelled"
        );
        assert_eq!(store.cancel("a"), Err(()));
        store.insert(
            "q".to_owned(),
            Stored {
                response: json!({"status": "queued"}),
                conversation: Vec::new(),
            },
        );
        assert_eq!(store.cancel("q"), Ok(Some(json!({"status": "cancelled"}))));
        store.finish(
            "q".to_owned(),
            Stored {
                response: json!({"status": "completed"}),
                conversation: Vec::new(),
            },
        );
        assert_eq!(store.get("q").unwrap().response["status"], "cancelled");
        assert_eq!(store.len(), 2, "b made room for q");
    }

    #[test]
    fn a_running_response_is_not_forgotten_to_make_room() {
        let store = ResponseStore::new(1);
        let stored = |status: &str| Stored {
            response: json!({"status": status}),
            conversation: Vec::new(),
        };
        store.insert("running".to_owned(), stored("queued"));
        store.insert("done".to_owned(), stored("completed"));
        assert!(store.get("running").is_some(), "kept while it runs");
        assert_eq!(store.len(), 2, "over capacity while one runs");
        store.insert("next".to_owned(), stored("completed"));
        assert!(store.get("done").is_none(), "the oldest finished one goes");
        store.finish("running".to_owned(), stored("completed"));
        store.insert("last".to_owned(), stored("completed"));
        assert_eq!(store.len(), 1);
        assert!(store.get("last").is_some());
    }
}
