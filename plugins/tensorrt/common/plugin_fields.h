// Plugin field helpers: typed lookup of creator fields with validation, and owned storage for the
// PluginFieldCollection a plugin hands out (getFieldNames, getFieldsToSerialize).
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace dhisparse
{
namespace trt
{

//! Reads named scalar fields of a PluginFieldCollection; missing fields keep their defaults.
class FieldReader
{
public:
    explicit FieldReader(nvinfer1::PluginFieldCollection const* fc)
        : mFc(fc)
    {
    }

    int32_t get_int32(char const* name, int32_t fallback) const
    {
        nvinfer1::PluginField const* f = find(name, nvinfer1::PluginFieldType::kINT32);
        int32_t value = fallback;
        if (f != nullptr)
        {
            std::memcpy(&value, f->data, sizeof(value));
        }
        return value;
    }

    float get_float32(char const* name, float fallback) const
    {
        nvinfer1::PluginField const* f = find(name, nvinfer1::PluginFieldType::kFLOAT32);
        float value = fallback;
        if (f != nullptr)
        {
            std::memcpy(&value, f->data, sizeof(value));
        }
        return value;
    }

private:
    nvinfer1::PluginField const* find(char const* name, nvinfer1::PluginFieldType type) const
    {
        for (int32_t i = 0; mFc != nullptr && i < mFc->nbFields; ++i)
        {
            nvinfer1::PluginField const& f = mFc->fields[i];
            if (f.name != nullptr && std::strcmp(f.name, name) == 0)
            {
                if (f.type != type || f.length != 1 || f.data == nullptr)
                {
                    throw std::invalid_argument(std::string("plugin field '") + name + "' must be one scalar of its type");
                }
                return &f;
            }
        }
        return nullptr;
    }

    nvinfer1::PluginFieldCollection const* mFc;
};

//! A PluginFieldCollection whose PluginField entries point at caller-owned scalars.
class FieldList
{
public:
    void add(char const* name, int32_t const* value)
    {
        mFields.emplace_back(name, value, nvinfer1::PluginFieldType::kINT32, 1);
    }

    void add(char const* name, float const* value)
    {
        mFields.emplace_back(name, value, nvinfer1::PluginFieldType::kFLOAT32, 1);
    }

    nvinfer1::PluginFieldCollection const* collection()
    {
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.data();
        return &mCollection;
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

inline void require(bool condition, char const* message)
{
    if (!condition)
    {
        throw std::invalid_argument(message);
    }
}

} // namespace trt
} // namespace dhisparse
