//! Arrow values → serde_json values, so parquet rows enter the same normalization path as JSON rows.
//!
//! A struct's null fields are left out. Arrow gives a struct the union of the keys every row has (Hugging Face
//! `datasets` writes nested dicts so, and so does pyarrow's inference), so a null field is almost always a key
//! the row never had: kept, `{"city": "Oslo"}` of one call would come back with every other call's argument
//! names as nulls, and templates print them into the calls the model learns (TRL's `remove_none_values`
//! exists for the same reason). A map's entries are the row's own, nulls included.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, *};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use serde_json::{Map, Number, Value};

/// Row `row` of `batch` as a JSON object keyed by column name.
pub fn row_to_json(batch: &RecordBatch, row: usize) -> Value {
    let schema = batch.schema();
    let mut obj = Map::with_capacity(batch.num_columns());
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        obj.insert(field.name().clone(), value_at(column.as_ref(), row));
    }
    Value::Object(obj)
}

fn float(v: f64) -> Value {
    Number::from_f64(v).map(Value::Number).unwrap_or(Value::Null)
}

/// One cell as JSON: nested lists and structs recurse; types without a JSON form use Arrow's display.
pub fn value_at(array: &dyn Array, row: usize) -> Value {
    if array.is_null(row) {
        return Value::Null;
    }
    match array.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(array.as_boolean().value(row)),
        DataType::Int8 => array.as_primitive::<Int8Type>().value(row).into(),
        DataType::Int16 => array.as_primitive::<Int16Type>().value(row).into(),
        DataType::Int32 => array.as_primitive::<Int32Type>().value(row).into(),
        DataType::Int64 => array.as_primitive::<Int64Type>().value(row).into(),
        DataType::UInt8 => array.as_primitive::<UInt8Type>().value(row).into(),
        DataType::UInt16 => array.as_primitive::<UInt16Type>().value(row).into(),
        DataType::UInt32 => array.as_primitive::<UInt32Type>().value(row).into(),
        DataType::UInt64 => array.as_primitive::<UInt64Type>().value(row).into(),
        DataType::Float16 => float(array.as_primitive::<Float16Type>().value(row).to_f64()),
        DataType::Float32 => float(array.as_primitive::<Float32Type>().value(row) as f64),
        DataType::Float64 => float(array.as_primitive::<Float64Type>().value(row)),
        DataType::Utf8 => Value::String(array.as_string::<i32>().value(row).to_string()),
        DataType::LargeUtf8 => Value::String(array.as_string::<i64>().value(row).to_string()),
        DataType::Utf8View => Value::String(array.as_string_view().value(row).to_string()),
        DataType::List(_) => list(array.as_list::<i32>().value(row).as_ref()),
        DataType::LargeList(_) => list(array.as_list::<i64>().value(row).as_ref()),
        DataType::FixedSizeList(_, _) => list(array.as_fixed_size_list().value(row).as_ref()),
        DataType::Struct(fields) => {
            let s = array.as_struct();
            let mut obj = Map::with_capacity(fields.len());
            for (field, child) in fields.iter().zip(s.columns()).filter(|(_, child)| !null_at(child.as_ref(), row)) {
                obj.insert(field.name().clone(), value_at(child.as_ref(), row));
            }
            Value::Object(obj)
        }
        DataType::Map(_, _) => {
            let entries = array.as_map().value(row);
            let (keys, values) = (entries.column(0), entries.column(1));
            let key = |i: usize| match value_at(keys.as_ref(), i) {
                Value::String(k) => k,
                other => other.to_string(),
            };
            Value::Object((0..entries.len()).map(|i| (key(i), value_at(values.as_ref(), i))).collect())
        }
        DataType::Dictionary(_, _) => {
            let dict = array.as_any_dictionary();
            let key = dict.normalized_keys()[row];
            value_at(dict.values().as_ref(), key)
        }
        _ => match ArrayFormatter::try_new(array, &FormatOptions::default()) {
            Ok(fmt) => Value::String(fmt.value(row).to_string()),
            Err(_) => Value::Null,
        },
    }
}

/// Null at `row`, also in a column of Arrow's null type (no validity buffer: every value null), which pyarrow
/// infers for a key no row gives a value.
fn null_at(array: &dyn Array, row: usize) -> bool {
    array.is_null(row) || *array.data_type() == DataType::Null
}

fn list(values: &dyn Array) -> Value {
    Value::Array((0..values.len()).map(|i| value_at(values, i)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Int64Array, Int64Builder, ListArray, StringArray, StringBuilder, StructArray};
    use arrow::buffer::OffsetBuffer;
    use std::sync::Arc;

    #[test]
    fn list_of_structs_becomes_list_of_objects() {
        let roles: ArrayRef = Arc::new(StringArray::from(vec!["user", "assistant", "user"]));
        let contents: ArrayRef = Arc::new(StringArray::from(vec![Some("q"), Some("a"), None]));
        let fields =
            Fields::from(vec![Field::new("role", DataType::Utf8, false), Field::new("content", DataType::Utf8, true)]);
        let structs = StructArray::new(fields.clone(), vec![roles, contents], None);
        let lists = ListArray::new(
            Arc::new(Field::new("item", DataType::Struct(fields), true)),
            OffsetBuffer::new(vec![0, 2, 3].into()),
            Arc::new(structs),
            None,
        );
        let ids = Int64Array::from(vec![7, 8]);
        let batch = RecordBatch::try_from_iter(vec![
            ("conversations", Arc::new(lists) as ArrayRef),
            ("id", Arc::new(ids) as ArrayRef),
        ])
        .unwrap();
        assert_eq!(
            row_to_json(&batch, 0),
            serde_json::json!({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "id": 7})
        );
        // The second row's message has no content: the key is left out, as the row never had it.
        assert_eq!(row_to_json(&batch, 1)["conversations"], serde_json::json!([{"role": "user"}]));
    }

    #[test]
    fn a_structs_null_fields_are_left_out_and_a_maps_entries_kept() {
        use arrow::array::{MapBuilder, NullArray};

        // Arguments stored as the union of two calls' keys: {city, unit} and {city: null, unit}, and a key
        // no row has a value for (Arrow's null type).
        let city: ArrayRef = Arc::new(StringArray::from(vec![Some("Oslo"), None]));
        let unit: ArrayRef = Arc::new(StringArray::from(vec![None, Some("celsius")]));
        let never: ArrayRef = Arc::new(NullArray::new(2));
        let fields = Fields::from(vec![
            Field::new("city", DataType::Utf8, true),
            Field::new("unit", DataType::Utf8, true),
            Field::new("never", DataType::Null, true),
        ]);
        let arguments = StructArray::new(fields, vec![city, unit, never], None);
        assert_eq!(value_at(&arguments, 0), serde_json::json!({"city": "Oslo"}));
        assert_eq!(value_at(&arguments, 1), serde_json::json!({"unit": "celsius"}));

        let mut map = MapBuilder::new(None, StringBuilder::new(), Int64Builder::new());
        map.keys().append_value("b");
        map.values().append_value(2);
        map.keys().append_value("a");
        map.values().append_null();
        map.append(true).unwrap();
        map.append(false).unwrap();
        let map = map.finish();
        // In the map's own order, with its null value: a map holds only the row's entries.
        assert_eq!(serde_json::to_string(&value_at(&map, 0)).unwrap(), r#"{"b":2,"a":null}"#);
        assert_eq!(value_at(&map, 1), Value::Null);
    }
}
