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
}

impl ResponseStore {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<String, Stored>, VecDeque<String>)> {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub(super) fn insert(&self, id: String, stored: Stored) {
        let mut guard = self.lock();
        let (map, order) = &mut *guard;
        if map.insert(id.clone(), stored).is_none() {
            order.push_back(id);
        }
        while map.len() > self.capacity {
            let Some(oldest) = order.pop_front() else {
                break;
            };
            map.remove(&oldest);
        }
    }

    pub(super) fn get(&self, id: &str) -> Option<Stored> {
        self.lock().0.get(id).cloned()
    }

    pub(super) fn remove(&self, id: &str) -> bool {
        let mut guard = self.lock();
        let (map, order) = &mut *guard;
        if map.remove(id).is_none() {
            return false;
        }
        order.retain(|kept| kept != id);
        true
    }

    /// Responses stored now.
    pub(crate) fn len(&self) -> usize {
        self.lock().0.len()
    }
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
        assert!(store.remove("b"));
        assert!(!store.remove("b"));
        assert_eq!(store.len(), 1);
    }
}
